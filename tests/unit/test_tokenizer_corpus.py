"""Fast checks of the bundled tokenizer, corpus split and held-out example shards.

They read the committed artifacts (models/tiny-orthrus-py, examples/shards); nothing is trained.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orthrus_train import corpus
from support.paths import REPO

ROOT = REPO
MODEL_DIR = ROOT / "models" / "tiny-orthrus-py"
SHARDS_DIR = ROOT / "examples" / "shards"

CODE_SAMPLES = [
    "def f(x):\n    return x + 1\n",
    'class A:\n    """Doc."""\n\n    def m(self, *a, **kw):\n        if a:\n\t\treturn [i ** 2 for i in a]  # tab\n'
    "        return {'k': kw}\n\n\n",
    "x = 'unicode: é 漢字 🐍'\r\nlambda: None   \n    \n",
    "   leading spaces and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def tok():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_roundtrip_code(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_roundtrip_real_source(tok):
    text = Path(corpus.__file__).read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens_are_single_ids(tok):
    ids = {}
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        enc = tok.encode(s, add_special_tokens=False)
        assert len(enc) == 1, s
        ids[s] = enc[0]
        # Also inside running text, and not split by surrounding characters.
        assert ids[s] in tok.encode("x" + s + "\ny", add_special_tokens=False)
    assert len(set(ids.values())) == 3
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Specials take the last ids, so the mask token (len(tok)) is one past them.
    assert max(ids.values()) == len(tok) - 1
    assert tok.encode("def f():", add_special_tokens=True) == tok.encode("def f():", add_special_tokens=False)


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Complete this function:\ndef f():\n"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == corpus.render_chat(msgs, add_generation_prompt=True)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == corpus.render_chat(msgs)
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.slow
def test_split_is_disjoint_and_deterministic():
    files = corpus.list_files()
    assert len(files) > 100
    train, held = corpus.split_files(files)
    assert not set(train) & set(held)
    assert set(train) | set(held) == set(files)
    assert 0.02 < len(held) / len(files) < 0.15
    assert (train, held) == corpus.split_files(reversed(files))
    assert not any(f.split("/")[0] in ("test", "idlelib", "lib2to3") for f in files)
    assert all(corpus.is_heldout(f) for f in held) and not any(corpus.is_heldout(f) for f in train)


def _shard_table():
    import pyarrow.dataset as ds

    return ds.dataset(str(SHARDS_DIR), format="parquet").to_table()


def test_example_shards():
    paths = sorted(SHARDS_DIR.glob("*.parquet"))
    assert len(paths) >= 3
    assert sum(p.stat().st_size for p in paths) < 1_000_000
    table = _shard_table()
    assert {"id", "prompt", "messages", "source"} <= set(table.column_names)
    rows = table.to_pylist()
    assert len(rows) >= 200
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["prompt"].lstrip().startswith(("def ", "async def ")) and r["prompt"].endswith("\n")
        assert r["messages"][0]["role"] == "user" and r["prompt"] in r["messages"][0]["content"]


def test_example_prompts_come_from_heldout_files_only(tok):
    _, held = corpus.split_files(corpus.list_files())
    for r in _shard_table().to_pylist():
        path = r["source"].split(":")[0]
        # is_heldout is a pure function of the path, so this holds on any Python build.
        assert corpus.is_heldout(path), path
        assert path in held or not (corpus.stdlib_dir() / path).exists()
        assert len(tok.encode(r["prompt"], add_special_tokens=False)) <= 300


def test_bundled_config_matches_tokenizer(tok):
    cfg_path = MODEL_DIR / "config.json"
    if not cfg_path.exists():
        pytest.skip("base model not trained yet (jobs.train_base)")
    cfg = json.loads(cfg_path.read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["OrthrusLM"]
    assert cfg["mask_token_id"] == len(tok) and cfg["vocab_size"] >= len(tok) + 1
    assert cfg["block_size"] >= 2 and cfg["tie_word_embeddings"] is True
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 16 * 2**20
    assert (MODEL_DIR / "generation_config.json").exists()
