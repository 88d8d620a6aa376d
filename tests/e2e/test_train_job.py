"""jobs.train end to end on a tiny random model: trains, saves in the released layout, resumes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config

from orthrus import OrthrusForCausalLM
from support.paths import REPO
from support.hang import HANG_S

ROOT = REPO
BUNDLED = ROOT / "models" / "tiny-orthrus-py"


def _tiny_dir(tmp: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    cfg = Qwen3Config(vocab_size=len(tok) + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    cfg.block_size, cfg.mask_token_id = 4, len(tok)
    torch.manual_seed(0)
    model_dir = tmp / "base"
    OrthrusForCausalLM(cfg).save_pretrained(str(model_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, model_dir / name)
    return model_dir


def _run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "jobs.train", *args], cwd=ROOT, check=True, timeout=HANG_S,
                   capture_output=True)


def test_train_job_trains_twins_saves_and_resumes(tmp_path):
    base = _tiny_dir(tmp_path)
    data = tmp_path / "text"
    data.mkdir()
    for p in sorted((ROOT / "orthrus").glob("*.py"))[:4]:
        (data / (p.name + ".txt")).write_text(p.read_text())
    out = tmp_path / "out"
    common = ["--model", str(base), "--out", str(out), "--data", str(data), "--seq-len", "64",
              "--anchors", "4", "--block-size", "4", "--batch-size", "2", "--save-every", "3",
              "--eval-every", "0", "--eval-prompts", "0", "--threads", "1"]
    _run(*common, "--steps", "3", "--self-distill", "4")   # + the model's own continuations
    first = OrthrusForCausalLM.from_pretrained(str(out))
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 3
    _run(*common, "--steps", "6")                               # same --out: resumes at step 3
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 6
    assert "resumed at step 3" in (out / "train.log").read_text()
    second = OrthrusForCausalLM.from_pretrained(str(out))
    base_model = OrthrusForCausalLM.from_pretrained(str(base))
    for (name, p0), p1, p2 in zip(base_model.named_parameters(), first.parameters(), second.parameters()):
        if "_diff." in name:
            assert not torch.equal(p1, p2)                      # training went on after the resume
        else:
            assert torch.equal(p0, p2), name                    # the AR view never changes
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["OrthrusLM"] and cfg["block_size"] == 4
    assert (out / "tokenizer.json").is_file()


def test_own_fraction_sets_the_share_of_own_continuations(tmp_path):
    base = _tiny_dir(tmp_path)
    data = tmp_path / "text"
    data.mkdir()
    (data / "a.txt").write_text((ROOT / "orthrus" / "sampling.py").read_text() * 4)
    rows = {}
    for fraction in ("1.0", "0.5"):
        out = tmp_path / f"out{fraction}"
        _run("--model", str(base), "--out", str(out), "--data", str(data), "--seq-len", "64", "--anchors", "4",
             "--block-size", "4", "--batch-size", "2", "--eval-every", "0", "--eval-prompts", "0", "--threads", "1",
             "--steps", "1", "--self-distill", "4", "--own-fraction", fraction, "--own-temperature", "0.7")
        log = (out / "train.log").read_text()
        rows[fraction] = int(log.split("rows=(", 1)[1].split(",", 1)[0])
    # 4 continuations of 64 + 192 tokens = 16 rows of 64; half own = as many corpus rows again
    assert rows == {"1.0": 16, "0.5": 32}
