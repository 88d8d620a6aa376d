"""``min_tokens`` (vLLM's meaning): no stop token before N generated tokens, exact under speculation.

The stop ids are masked out of the target distribution at positions before N, so a draft that is one
is rejected. Greedy equals transformers' plain AR with ``min_new_tokens`` in float64 (every mode, a
ragged batch row for row); seeded sampling matches the enumerated masked AR distribution (χ²).
"""
from __future__ import annotations


import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from support.oracles import assert_follows, enumerate_ar
from support.tiny_models import hf_twin, tiny_model

PROMPTS = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13], [14], [20, 21, 22, 23]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, diff_noise=0.3, scale=4.0)


def _hf_greedy(hf, prompt: list[int], stops: list[int], min_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=min_new,
                      do_sample=False, eos_token_id=stops, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# (stop ids, min_tokens) per prompt. Without min_tokens each row ends before its min: rows 1 and 3 by
# EOS (63), rows 0, 2 and 4 by their stop id, row 2 at its very first token (the prefill's sample).
LIMITS = [((43,), 5), ((), 6), ((5,), 3), ((), 10), ((23,), 4)]


def _cases(model) -> list[tuple[list[int], SamplingParams]]:
    return [(prompt, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stops, min_tokens=n))
            for prompt, (stops, n) in zip(PROMPTS, LIMITS)]


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_greedy_min_tokens_equals_transformers(model, speculative):
    hf = hf_twin(model)
    cases = _cases(model)
    engine = OrthrusEngine(model, max_batch_size=3)
    got = engine.generate([p for p, _ in cases], [sp for _, sp in cases], speculative=speculative)   # ragged batch
    for (prompt, sp), r in zip(cases, got):
        stops = list(model.eos_token_ids) + list(sp.stop_token_ids)
        assert r.token_ids == _hf_greedy(hf, prompt, stops, sp.min_tokens)
        assert not set(r.token_ids[: sp.min_tokens]) & set(stops)              # no stop before min_tokens
        alone = OrthrusEngine(model, max_batch_size=1).generate([prompt], sp, speculative=speculative)[0]
        assert alone.token_ids == r.token_ids                                  # the batch changes nothing
    # min_tokens did change the outputs: without it every row ends at its early stop
    free = engine.generate([p for p, _ in cases], [SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=sp.stop_token_ids)
                                                   for _, sp in cases])
    assert all(len(f.token_ids) < sp.min_tokens <= len(r.token_ids) for f, r, (_, sp) in zip(free, got, cases))


VOCAB, EOS, HORIZON, MIN, N = 7, 5, 4, 2, 20_000
PROMPT = [1, 2, 3, 0]
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.95, max_new_tokens=HORIZON)


def _exact(model, min_tokens: int) -> dict[tuple[int, ...], float]:
    """P(sequence) under the processed AR model with EOS forbidden before ``min_tokens``, by enumeration."""
    def forbid(prefix: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
        if len(prefix) < min_tokens:
            logits[EOS] = float("-inf")
        return logits
    return enumerate_ar(model, PROMPT, PARAMS, EOS, forbid)


@pytest.mark.slow
def test_sampled_min_tokens_match_the_masked_ar_distribution():
    model = tiny_model(seed=3, vocab=VOCAB, eos=EOS, block_size=3, diff_noise=0.7, scale=3.0)
    engine = OrthrusEngine(model, max_batch_size=512)
    params = [SamplingParams(seed=s, min_tokens=MIN, **PARAMS) for s in range(N)]
    results = engine.generate([PROMPT] * N, params, speculative=True)
    assert sum(r.stats.accept_length_histogram[0] for r in results) > 0        # drafts were rejected too
    assert_follows(results, _exact(model, MIN), null=_exact(model, 0))
