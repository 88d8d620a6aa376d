"""Greedy speculative decoding is exactly AR decoding (float64), in ragged batches with refills."""
from __future__ import annotations

import pytest

from orthrus import OrthrusEngine, SamplingParams
from orthrus.engine.step import AR
from support.tiny_models import hf_greedy, hf_twin, tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23],
           [24, 25, 26], [27]]


@pytest.fixture(scope="module", params=[0.0, 0.5], ids=["twins=AR", "twins=perturbed"])
def model(request):
    return tiny_model(seed=1, diff_noise=request.param, scale=4.0)


def test_ragged_batch_equals_ar_alone_and_hf_generate(model):
    engine = OrthrusEngine(model, max_batch_size=3)          # 8 prompts > 3 slots: slots refill
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    spec = engine.generate(PROMPTS, params, speculative=True)
    hf = hf_twin(model)
    for prompt, got in zip(PROMPTS, spec):
        alone = engine.generate([prompt], params, speculative=False)[0]
        assert got.token_ids == alone.token_ids
        assert got.finish_reason == alone.finish_reason
        assert got.token_ids == hf_greedy(hf, prompt, 24, engine.eos_token_ids)
    assert any(r.finish_reason == "stop" for r in spec) or all(len(r.token_ids) == 24 for r in spec)


def test_stats_are_consistent(model):
    engine = OrthrusEngine(model, max_batch_size=4)
    res = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    for r in res:
        s = r.stats
        assert sum(s.accept_length_histogram) == s.num_cycles
        assert len(s.accept_length_histogram) == engine.block_size
        assert s.num_accepted_draft_tokens == sum(i * c for i, c in enumerate(s.accept_length_histogram))
        assert s.num_draft_tokens == s.num_cycles * (engine.block_size - 1)
        assert s.num_forward_passes == 1 + 2 * s.num_cycles and s.num_ar_steps == 0
        # every emitted token after the first comes from a cycle: at most L + 1 per cycle
        assert len(r.token_ids) - 1 <= s.num_accepted_draft_tokens + s.num_cycles
        assert s.tokens_per_cycle == pytest.approx((s.num_accepted_draft_tokens + s.num_cycles) / max(s.num_cycles, 1))


def test_stop_token_ids_and_context_limit(model):
    engine = OrthrusEngine(model, max_batch_size=2, max_seq_len=12)
    base = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=50), speculative=False)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12 - 3   # context limit
    stop_tok = base.token_ids[4]
    cut = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=50, stop_token_ids=(stop_tok,)))[0]
    first = base.token_ids.index(stop_tok)
    assert cut.token_ids == base.token_ids[: first + 1] and cut.finish_reason == "stop"


def test_max_new_tokens_one_and_block_size_override(model):
    engine = OrthrusEngine(model, max_batch_size=2, block_size=6)
    r = engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=1))
    assert [len(x.token_ids) for x in r] == [1, 1] and all(x.stats.num_cycles == 0 for x in r)
    long = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30))[0]
    ar = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30), speculative=False)[0]
    assert long.token_ids == ar.token_ids and len(long.stats.accept_length_histogram) == 6


def test_greedy_rows_stay_exact_in_a_batch_that_also_samples(model):
    """Mixed batches take the general probability path; greedy rows must still equal AR."""
    engine = OrthrusEngine(model, max_batch_size=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    params = [greedy if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=8, max_new_tokens=20, seed=i)
              for i in range(len(PROMPTS))]
    mixed = engine.generate(PROMPTS, params)
    for i, (prompt, got) in enumerate(zip(PROMPTS, mixed)):
        if i % 2 == 0:
            assert got.token_ids == engine.generate([prompt], greedy, speculative=False)[0].token_ids


def test_auto_speculation_is_exact_and_reports_both_kinds_of_iteration(model):
    engine = OrthrusEngine(model, max_batch_size=3)
    params = SamplingParams(max_new_tokens=40)
    auto = engine.generate(PROMPTS, params, speculative="auto")
    policy = engine.scheduler.speculation.policy
    ar = engine.generate(PROMPTS, params, speculative=False)
    assert [r.token_ids for r in auto] == [r.token_ids for r in ar]
    assert policy.arms == (AR, 4, 2) and all(n > 0 for n in policy.chosen.values())   # every arm measured
    for r in auto + ar:
        s = r.stats
        assert s.num_forward_passes == 1 + 2 * s.num_cycles + s.num_ar_steps
        assert sum(s.accept_length_histogram) == s.num_cycles
        assert s.num_cycles <= s.num_draft_tokens <= 3 * s.num_cycles      # 1 or 3 drafts per cycle
    assert all(r.stats.num_cycles == 0 and r.stats.tokens_per_cycle == 1.0 for r in ar if r.stats.num_ar_steps)
    with pytest.raises(ValueError, match="speculative"):
        engine.generate(PROMPTS, params, speculative="sometimes")
