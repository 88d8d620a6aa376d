"""Shared fixtures (kept small): a tiny random Orthrus checkpoint with the bundled tokenizer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "tiny-orthrus-py"


@pytest.fixture(scope="session")
def tiny_orthrus_dir(tmp_path_factory) -> Path:
    """HF-layout dir: random 2-layer Orthrus (block size 4) + the bundled tokenizer files."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config

    from orthrus import OrthrusForCausalLM

    out = tmp_path_factory.mktemp("tiny-orthrus")
    for f in TOKENIZER_DIR.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = Qwen3Config(vocab_size=len(tok) + 1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=[tok.convert_tokens_to_ids(t)
                                                             for t in ("<|im_end|>", "<|endoftext|>")])
    cfg.block_size = 4
    cfg.mask_token_id = len(tok)
    torch.manual_seed(0)
    OrthrusForCausalLM(cfg).save_pretrained(str(out))
    return out
