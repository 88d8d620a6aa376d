"""The bundled trained model: loads natively, decodes losslessly, and its diffusion view works."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from support.paths import REPO, TOKENIZER_DIR

BUNDLED = TOKENIZER_DIR
SHARDS = REPO / "examples" / "shards"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    return load_prompt_ids(tok, str(SHARDS), 8)


def _tokens_per_cycle(model, prompts) -> float:
    res = OrthrusEngine(model, max_batch_size=6).generate(prompts, SamplingParams(max_new_tokens=40))
    cycles = sum(r.stats.num_cycles for r in res)
    return (sum(r.stats.num_accepted_draft_tokens for r in res) + cycles) / cycles


def test_bundled_checkpoint_layout_and_size():
    cfg = json.loads((BUNDLED / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["OrthrusLM"]
    assert cfg["mask_token_id"] == cfg["vocab_size"] - 1 and cfg["block_size"] >= 2
    total = sum(p.stat().st_size for p in BUNDLED.iterdir() if p.is_file())
    assert total <= 16 * 2 ** 20


@pytest.mark.slow
def test_bundled_greedy_speculative_equals_ar(prompts):
    model = OrthrusForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float64)   # exactness: float64
    engine = OrthrusEngine(model, max_batch_size=4)
    params = SamplingParams(max_new_tokens=40)
    spec = engine.generate(prompts, params, speculative=True)
    ar = engine.generate(prompts, params, speculative=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]


@pytest.mark.slow
def test_bundled_diffusion_view_beats_an_untrained_one(prompts):
    """A floor measured in the same run: the same model with its twins reset to the AR weights
    (what the diffusion view is before training) must accept clearly fewer drafts."""
    model = OrthrusForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32)
    trained = _tokens_per_cycle(model, prompts)
    model.copy_ar_to_diffusion()
    untrained = _tokens_per_cycle(model, prompts)
    assert trained > 1.1 * untrained, (trained, untrained)
    assert trained > 1.5
