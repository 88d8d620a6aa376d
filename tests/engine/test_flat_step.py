"""The flat step: prompts of very different lengths prefilled as one flat token batch (no padding
reaches a linear layer), exact against transformers in float64, and the counters that show it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from orthrus.model.backends import RaggedSDPA
from orthrus.model.cache import PagedKVCache
from orthrus.model.ragged import AttentionGroup, RaggedBatch, pad_layout
from support.tiny_models import hf_greedy, hf_twin, tiny_model


def _log_uniform_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(np.log(low), np.log(high), n)).astype(int)
    return [rng.integers(1, 60, size=int(k)).tolist() for k in lens]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, diff_noise=0.5, scale=4.0)


def test_pad_layout_takes_and_puts_every_real_token_once():
    take, put = pad_layout([3, 1, 2])
    assert take.tolist() == [0, 1, 2, 3, 3, 3, 4, 5, 5]          # pads repeat their row's last token
    assert put.tolist() == [0, 1, 2, 3, 6, 7]                    # each real token's padded cell
    assert (take[put] == np.arange(6)).all()
    assert pad_layout([4, 4]) is None                            # equal rows: a view, no copies


def test_ragged_forward_equals_padded_forward_row_by_row(model):
    """One flat forward over rows of 5, 1 and 3 tokens (two attention groups) gives each row's
    hidden states and K/V exactly as a forward of that row alone."""
    cfg = model.config
    attn = model.model.layers[0].self_attn
    rows = [[5, 9, 2, 7, 1], [3], [8, 8, 4]]
    starts = [0, 0, 0]

    def cache():
        return PagedKVCache.contiguous(cfg.num_hidden_layers, 3, attn.num_kv_heads, 64, attn.head_dim,
                                       torch.float64, "cpu")
    flat_cache = cache()
    groups = ((0, 2), (1,))                                     # rows 0 and 2 padded together, row 1 alone
    order = [i for g in groups for i in g]
    tokens = torch.tensor([t for i in order for t in rows[i]])
    positions = torch.cat([torch.arange(len(rows[i])) + starts[i] for i in order])
    built, first = [], 0
    for g in groups:
        lens = [len(rows[i]) for i in g]
        t = max(lens)
        layout = pad_layout(lens)
        take, put = (None, None) if layout is None else map(torch.as_tensor, layout)
        pos = torch.tensor([[starts[i] + j for j in range(t)] for i in g])
        built.append(AttentionGroup(torch.tensor(g), pos, first, sum(lens), t, take, put))
        first += sum(lens)
    out = model.forward_ragged(tokens, flat_cache, RaggedBatch(positions, tuple(built)), False, RaggedSDPA())
    at = 0
    for i in order:
        alone = model.forward_dense(torch.tensor([rows[i]]))[0]
        torch.testing.assert_close(out[at: at + len(rows[i])], alone, rtol=0, atol=1e-12)
        at += len(rows[i])


@pytest.mark.parametrize("speculative", [True, False, "auto"])
def test_ragged_prompts_greedy_equal_transformers_and_compute_no_padding(model, speculative):
    prompts = _log_uniform_prompts(10, 1, 180, seed=5)
    engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    got = engine.generate(prompts, params, speculative=speculative)
    hf = hf_twin(model)
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(hf, prompt, 12, engine.eos_token_ids)
    stats = engine.stats
    # flat prefill: exactly the prompt tokens computed (the old padded forwards computed up to
    # rows x the longest rest), and the decode forwards on top
    assert stats.prefill_token_slots == stats.prefill_tokens + stats.recomputed_tokens > 0
    assert stats.forward_token_slots > stats.prefill_token_slots
