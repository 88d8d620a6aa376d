"""GPU-path choices that change no token, checked on the CPU: rounded key lengths (few SDPA shapes),
masks and indices made once per forward (not per layer), and the flash probe behind 'auto'."""
from __future__ import annotations

import warnings

import pytest
import torch.nn.functional as F

from orthrus import OrthrusEngine, SamplingParams
from orthrus.model import backends, flash
from support.oracles import reference_flash_attn_with_kvcache
from support.tiny_models import tiny_model

PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=18)] * 5 + [
    SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=18, seed=i) for i in range(5)]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23],
           [24, 25, 26], [27], [28, 29], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, diff_noise=0.3, scale=4.0)


def _tokens(model, key_bucket: int, speculative, monkeypatch=None) -> tuple[list, set[int]]:
    lengths: set[int] = set()
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, *args, **kwargs):
        lengths.add(k.shape[2])
        return sdpa(q, k, *args, **kwargs)

    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=False, key_bucket=key_bucket)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends.F, "scaled_dot_product_attention", recording)
        out = engine.generate(PROMPTS, PARAMS, speculative=speculative)
    return [r.token_ids for r in out], lengths


@pytest.mark.parametrize("speculative", [True, False, "auto"])
def test_rounded_key_lengths_change_no_token(model, speculative):
    exact, exact_lengths = _tokens(model, 1, speculative)      # keys read in whole pages: multiples of 16
    rounded, lengths = _tokens(model, 64, speculative)
    # Greedy and seeded-sampled rows alike; under 'auto' only greedy: its timing-driven switching
    # changes which random numbers a sampled row draws (same distribution, not the same bits).
    compared = slice(0, 5) if speculative == "auto" else slice(None)
    assert rounded[compared] == exact[compared]
    capacity = OrthrusEngine(model, max_batch_size=4).cache.capacity
    assert all(n % 16 == 0 for n in exact_lengths)
    assert all(n % 64 == 0 or n == capacity for n in lengths) and len(lengths) < len(exact_lengths)


def test_masks_and_indices_are_made_once_per_forward(model, monkeypatch):
    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=False)
    prepared, masks = [], []
    real_prepare, real_attention = backends.RaggedSDPA.prepare, backends.ragged_attention

    def counting_prepare(self, *args, **kwargs):
        prepared.append(1)
        return real_prepare(self, *args, **kwargs)

    def checking_attention(q, k, v, mask, scale):
        masks.append(mask is not None)
        return real_attention(q, k, v, mask, scale)

    monkeypatch.setattr(backends.RaggedSDPA, "prepare", counting_prepare)
    monkeypatch.setattr(backends, "ragged_attention", checking_attention)
    engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6))
    layers = len(model.model.layers)
    assert all(masks) and len(masks) == layers * len(prepared)   # every layer reuses its forward's mask


def _auto_engine(model, monkeypatch, kernel):
    monkeypatch.setattr(flash, "unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(flash, "kernel", lambda: kernel)
    return OrthrusEngine(model, max_batch_size=4, attention="auto", static_shapes=False)


def test_auto_uses_flash_only_after_a_probe_call_succeeds(model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _auto_engine(model, monkeypatch, broken)
    assert engine.attention == "sdpa" and any("failed a probe call" in str(w.message) for w in caught)
    assert engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4))     # runs, on SDPA
    good = _auto_engine(model, monkeypatch, reference_flash_attn_with_kvcache)
    assert good.attention == "flash"
    sdpa = OrthrusEngine(model, max_batch_size=4, attention="sdpa", static_shapes=False)
    params = SamplingParams(max_new_tokens=8)
    assert [r.token_ids for r in good.generate(PROMPTS, params)] == [r.token_ids for r in sdpa.generate(PROMPTS, params)]
