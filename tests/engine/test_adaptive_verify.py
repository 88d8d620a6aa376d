"""A verify budget per cycle (``OrthrusEngine(adaptive_verify=...)``): each row verifies a prefix of
its drafts, chosen where the drafter is most confident, and the output stays the AR model's.

The budgets here are pinned (a verify policy that always picks one arm): the engine's own policy
picks by wall time, which a test must not depend on.
"""
from __future__ import annotations


import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from orthrus.engine.device.verify_budget import VerifyLayout, widths
from orthrus.model.backends import FlashKVCache
from orthrus.testing.pinned import pin
from support.oracles import assert_follows, enumerate_ar, reference_flash_attn_with_kvcache
from support.tiny_models import hf_greedy, hf_twin, tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23]]


def pinned_engine(model, eighths: int, speculative: bool | str = True, **kw) -> OrthrusEngine:
    return pin(OrthrusEngine(model, speculative=speculative, **kw), eighths, speculate=speculative == "auto")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, diff_noise=0.5, scale=4.0, block_size=6)


def test_widths_are_prefixes_that_spend_the_budget_where_the_drafter_is_confident():
    torch.manual_seed(0)
    conf = torch.rand(5, 7)
    useful = torch.arange(7)[None, :] < torch.tensor([7, 7, 3, 0, 7])[:, None]   # row 3: nothing to emit
    for budget in (1, 5, 12, 20, 35):
        w = widths(conf, useful, budget)
        assert int(w.sum()) == budget and (w <= 7).all()
        score = torch.where(useful, conf.cumprod(-1), -1.0)
        chosen = torch.arange(7)[None, :] < w[:, None]
        if budget <= int(useful.sum()):
            assert not (chosen & ~useful).any()                   # useful drafts come first
            assert score[chosen].min() >= score[~chosen].max()    # and the most confident of them
    layout = VerifyLayout.of(torch.tensor([2, 0, 3]), 4, 5)
    block = torch.arange(12).view(3, 4)
    assert layout.flat(block).tolist() == [0, 1, 2, 4, 8, 9, 10, 11]                 # anchors and verified drafts
    assert layout.cells(layout.flat(block)).tolist() == [[0, 1, 2, 2], [4, 4, 4, 4], [8, 9, 10, 11]]


@pytest.mark.parametrize("eighths", [1, 2, 4])
@pytest.mark.parametrize("speculative", [True, "auto"])
def test_greedy_rows_verifying_a_budget_equal_ar_and_transformers(model, eighths, speculative):
    """Ragged batch through 3 slots (refills), every row greedy: the tokens are AR's and
    transformers', and each cycle verified exactly its budget of the drafts."""
    engine = pinned_engine(model, eighths, speculative, max_batch_size=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    got = engine.generate(PROMPTS, params)
    ar = OrthrusEngine(model, max_batch_size=3, speculative=False).generate(PROMPTS, params)
    hf = hf_twin(model)
    for prompt, g, want in zip(PROMPTS, got, ar):
        assert g.token_ids == want.token_ids == hf_greedy(hf, prompt, 20, engine.eos_token_ids)
        s = g.stats
        assert s.num_accepted_draft_tokens <= s.num_verified_draft_tokens <= s.num_draft_tokens
    stats = engine.stats
    assert stats.verified_draft_tokens == sum(r.stats.num_verified_draft_tokens for r in got)
    assert stats.accepted_draft_tokens == sum(r.stats.num_accepted_draft_tokens for r in got)
    drafted = sum(r.stats.num_draft_tokens for r in got)
    assert 0 < stats.verified_draft_tokens <= drafted * eighths / 8 + stats.iterations   # the budget, rounded up


def test_adaptive_verify_off_verifies_every_draft(model):
    engine = OrthrusEngine(model, max_batch_size=3, adaptive_verify=False)
    got = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert all(r.stats.num_verified_draft_tokens == r.stats.num_draft_tokens for r in got)
    assert engine.stats.verified_draft_tokens == sum(r.stats.num_draft_tokens for r in got)


def test_sampled_rows_in_fixed_speculation_verify_every_draft(model):
    """A seeded sampled row's draws depend on its budget, which follows wall time: in fixed
    speculation it stays whole, so the same seed gives the same tokens run after run."""
    params = [SamplingParams(temperature=0.9, max_new_tokens=12, seed=s) for s in range(len(PROMPTS))]
    engine = pinned_engine(model, 1, True, max_batch_size=3)
    got = engine.generate(PROMPTS, params)
    assert all(r.stats.num_verified_draft_tokens == r.stats.num_draft_tokens for r in got)
    whole = OrthrusEngine(model, max_batch_size=3, adaptive_verify=False).generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in whole]


VOCAB, EOS, HORIZON, N = 7, 5, 3, 12_000
PROMPT = [1, 2, 3, 0]
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.9, max_new_tokens=HORIZON)


@pytest.mark.slow
def test_sampled_rows_verifying_a_budget_keep_the_ar_distribution():
    """χ² against the enumerated AR distribution of 3-token continuations: "auto" cycles verifying
    a quarter of their drafts, spread over the rows by the drafter's confidence."""
    model = tiny_model(seed=3, vocab=VOCAB, eos=EOS, block_size=3, diff_noise=0.7, scale=3.0)
    engine = pinned_engine(model, 2, "auto", max_batch_size=512)
    params = [SamplingParams(seed=7 * 10**6 + s, **PARAMS) for s in range(N)]
    results = engine.generate([PROMPT] * N, params)
    verified = sum(r.stats.num_verified_draft_tokens for r in results)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    assert 0 < verified < drafted / 2                           # the budget cut the verify pass
    assert_follows(results, enumerate_ar(model, PROMPT, PARAMS, EOS, lambda prefix, logits: logits))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_flash_convention_and_static_shapes_with_a_budget(model, static):
    """The budgeted verify forward through flash-attn's calling convention (a plain-torch stand-in
    for ``flash_attn_with_kvcache``) and the padded static path: AR's tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    want = OrthrusEngine(model, max_batch_size=3, speculative=False, attention="sdpa").generate(PROMPTS, params)
    flash = FlashKVCache(reference_flash_attn_with_kvcache)
    engine = pinned_engine(model, 2, True, max_batch_size=3, attention=flash, static_shapes=static)
    got = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert 0 < engine.stats.verified_draft_tokens < sum(r.stats.num_draft_tokens for r in got)
