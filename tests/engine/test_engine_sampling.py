"""Sampling: the speculative output distribution equals the AR distribution (χ², enumeration)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from orthrus import OrthrusEngine, SamplingParams
from orthrus.sampling import SamplingTensors, process
from support.oracles import chi2_pvalue
from support.tiny_models import tiny_model

VOCAB, EOS, HORIZON, N = 7, 5, 3, 20_000
PROMPT = [1, 2, 3, 0]
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.9, max_new_tokens=HORIZON)


def _st(n: int, t: float, k: int, p: float) -> SamplingTensors:
    return SamplingTensors(torch.full((n,), t, dtype=torch.float64), torch.full((n,), k),
                           torch.full((n,), p, dtype=torch.float64), torch.zeros(n, dtype=torch.bool), True)


def exact_distribution(model, temperature: float) -> dict[tuple[int, ...], float]:
    """P(sequence) under the processed AR model, by enumerating every continuation."""
    dist: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == HORIZON or (prefix and prefix[-1] == EOS):
            dist[prefix] = dist.get(prefix, 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(prefix)]))[:, -1:]
        probs = process(logits, _st(1, temperature, PARAMS["top_k"], PARAMS["top_p"]))[0, 0]
        for tok in range(VOCAB):
            if probs[tok] > 0:
                walk(prefix + (tok,), prob * float(probs[tok]))

    walk((), 1.0)
    return dist


@pytest.fixture(scope="module")
def model():
    # perturbed twins: q differs from p, so acceptance is partial and residual draws happen
    return tiny_model(seed=3, vocab=VOCAB, eos=EOS, block_size=3, diff_noise=0.7, scale=3.0)


@pytest.fixture(scope="module")
def exact(model):
    dist = exact_distribution(model, PARAMS["temperature"])
    assert abs(sum(dist.values()) - 1) < 1e-9 and len(dist) > 20
    return dist


@pytest.fixture(scope="module")
def spec_counts(model):
    engine = OrthrusEngine(model, max_batch_size=512)
    params = [SamplingParams(seed=s, **PARAMS) for s in range(N)]
    results = engine.generate([PROMPT] * N, params, speculative=True)
    hist = np.sum([r.stats.accept_length_histogram for r in results], axis=0)
    assert hist[0] > 0 and hist[-1] > 0                         # rejections and full accepts both occur
    return Counter(tuple(r.token_ids) for r in results)


@pytest.mark.slow
def test_speculative_samples_match_exact_ar_distribution(exact, spec_counts):
    assert set(spec_counts) <= set(exact), "sampled a sequence the processed AR model gives zero mass"
    assert chi2_pvalue(spec_counts, exact, N) > 1e-3


@pytest.mark.slow
def test_ar_mode_samples_match_exact_ar_distribution(model, exact):
    engine = OrthrusEngine(model, max_batch_size=512)
    params = [SamplingParams(seed=10**6 + s, **PARAMS) for s in range(N)]
    counts = Counter(tuple(r.token_ids) for r in engine.generate([PROMPT] * N, params, speculative=False))
    assert chi2_pvalue(counts, exact, N) > 1e-3


@pytest.mark.slow
def test_chi2_check_has_power(model, spec_counts):
    """The same check rejects a slightly wrong target (temperature 1.0 instead of 0.9)."""
    wrong = exact_distribution(model, 1.0)
    assert chi2_pvalue(spec_counts, wrong, N) < 1e-6


def test_processing_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.float64) * 3
    for t, k, p in [(0.7, 0, 0.9), (1.3, 10, 1.0), (0.5, 5, 0.6), (1.0, 1, 0.95)]:
        ref = logits.clone()
        ref = TemperatureLogitsWarper(t)(None, ref)
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        got = process(logits[:, None], _st(6, t, k, p))[:, 0]
        torch.testing.assert_close(got, ref.softmax(-1))
