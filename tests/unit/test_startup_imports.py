"""What a job imports before its first batch, kept small (docs/testing.md: start-up): the driver
(``jobs.generate``) imports no torch, and the model imports no transformers model code (its
``PreTrainedModel`` and ``modeling_qwen3`` pull in torch's compiler, sympy and scipy: seconds of
every actor's start on a small machine). Each check runs in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys

from support.hang import HANG_S
from support.paths import REPO


def _loaded_after(statement: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"import sys\n{statement}\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [m for m in proc.stdout.strip().split(",") if m]


def test_the_jobs_driver_imports_no_torch_and_no_model():
    assert _loaded_after("import jobs.generate", ("torch", "transformers", "orthrus.model", "orthrus.engine.engine")) == []


def test_the_model_and_its_loading_import_no_transformers_model_code_nor_torchs_compiler():
    load = "import orthrus\northrus.OrthrusForCausalLM.from_pretrained('models/tiny-orthrus-py')\nimport orthrus.engine.engine"
    assert _loaded_after(load, ("transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
                                "torch._dynamo", "sympy", "scipy")) == []


def test_the_tokenizer_loads_without_torch_and_equals_autotokenizers(qwen3_tokenizer_dir):
    """The driver's preflight and the read tasks load the class ``tokenizer_config.json`` names
    (no torch), and it is the tokenizer ``AutoTokenizer`` builds: same class, same ids, same chat text."""
    load = "from pipeline.storage.model_files import load_tokenizer\nload_tokenizer('models/tiny-orthrus-py')"
    assert _loaded_after(load, ("torch",)) == []
    from transformers import AutoTokenizer

    from pipeline.storage.model_files import load_tokenizer

    text = "def add(a, b):\n    return a + b  # caf\u00e9 <think> \u4f60\u597d"
    chat = [{"role": "user", "content": text}]
    for d in (str(REPO / "models/tiny-orthrus-py"), str(qwen3_tokenizer_dir)):
        ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
        assert type(ours) is type(auto)
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (auto.eos_token_id, auto.pad_token_id, len(auto))
