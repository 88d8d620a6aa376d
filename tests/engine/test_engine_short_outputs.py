"""No wasted block at a row's end: a row complete after its prefill takes no part in a cycle, and a
greedy iteration's block is never longer than its rows can still accept."""
from __future__ import annotations

import pytest

from orthrus import OrthrusEngine, SamplingParams
from orthrus.testing.host_syncs import count_host_reads
from support.tiny_models import hf_greedy, hf_twin, tiny_model

PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [9, 3], [2, 3, 8, 4]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, diff_noise=0.3, scale=4.0, block_size=4)


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_one_token_rows_run_no_iteration(model, speculative):
    engine = OrthrusEngine(model, max_batch_size=4)
    params = [SamplingParams(max_new_tokens=1, logprobs=2), SamplingParams(temperature=0.9, max_new_tokens=1, seed=3)]
    with count_host_reads() as reads:
        got = engine.generate(PROMPTS, params * 3, speculative=speculative)
    assert engine.stats.iterations == 0 and reads["cpu"] == 2          # two admitting steps, one read each
    alone = OrthrusEngine(model, max_batch_size=1, prefix_cache=False)
    for prompt, p, r in zip(PROMPTS, params * 3, got):
        want = alone.generate([prompt], p, speculative=False)[0]
        assert (r.token_ids, r.finish_reason) == (want.token_ids, want.finish_reason)
        assert r.token_logprobs == (None if want.token_logprobs is None else pytest.approx(want.token_logprobs, rel=1e-9))
        assert len(r.token_ids) == 1 and r.stats.num_cycles == 0 and r.stats.num_ar_steps == 0


def test_rows_done_at_prefill_share_a_step_with_running_rows(model):
    """Settled rows ride along in the step's one read next to a cycle of the rows that still run."""
    params = [SamplingParams(temperature=0.8, max_new_tokens=n, seed=i, logprobs=1)
              for i, n in enumerate([1, 12, 1, 9, 1, 1])]
    engine = OrthrusEngine(model, max_batch_size=3)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    done, steps = {}, 0
    with count_host_reads() as reads:
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step())
            steps += 1
    assert reads["cpu"] == steps                                    # one read per step, settled rows included
    got = [done[i] for i in ids]
    for prompt, p, r in zip(PROMPTS, params, got):
        want = OrthrusEngine(model, max_batch_size=1).generate([prompt], p)[0]
        assert r.token_ids == want.token_ids                     # logprobs: float64, batched matmuls round apart
        assert r.token_logprobs == pytest.approx(want.token_logprobs, rel=1e-9)


def test_greedy_block_is_capped_by_the_tokens_left(model):
    """Every greedy iteration's block fits the largest budget left (an AR step when 1 token is left)."""
    hf = hf_twin(model)
    budgets = [2, 3, 4, 5, 3, 7]
    engine = OrthrusEngine(model, max_batch_size=3)
    seen, plan = [], engine.runner.plan

    def recording(it, logprobs, busy):
        seen.append((it.block, int(engine.scheduler.table.remaining(it.slots).max())))
        return plan(it, logprobs, busy)

    engine.runner.plan = recording
    got = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in budgets])
    for prompt, n, r in zip(PROMPTS, budgets, got):
        assert r.token_ids == hf_greedy(hf, prompt, n, model.eos_token_ids)
    assert all(block <= left if left >= 2 else block == 0 for block, left in seen), seen
    assert {block for block, _ in seen} - {engine.block_size}          # some blocks were shorter than K


def test_sampled_rows_keep_full_blocks_so_a_seeded_row_ignores_its_batch(model):
    """A capped block would change a sampled row's draws with its batch-mates' budgets: not done."""
    target = SamplingParams(temperature=0.8, max_new_tokens=6, seed=11)
    others = SamplingParams(temperature=0.8, max_new_tokens=30, seed=12)
    alone = OrthrusEngine(model, max_batch_size=1).generate([PROMPTS[0]], target)[0]
    mixed = OrthrusEngine(model, max_batch_size=2).generate([PROMPTS[0], PROMPTS[1]], [target, others])[0]
    assert mixed.token_ids == alone.token_ids


def test_check_requests_column_wise_says_what_check_request_raises(model):
    """The batch form of the request check (flat ids + offsets, as Arrow holds them) names each row's
    problem exactly as the per-row check would, and passes the rest."""
    import numpy as np

    engine = OrthrusEngine(model, max_batch_size=2, max_seq_len=8)
    vocab = model.config.vocab_size
    rows = [([3, 1, 4], SamplingParams()), ([], SamplingParams()), ([2, vocab], SamplingParams()),
            ([5] * 8, SamplingParams()), ([-1, 2], SamplingParams()), ([7], SamplingParams(stop=("x",))),
            ([6, 5], SamplingParams(logprobs=2)), ([9], "not params")]
    offsets = np.cumsum([0] + [len(p) for p, _ in rows])
    flat = np.array([t for p, _ in rows for t in p], np.int32)
    got = engine.check_requests(flat, offsets, [p for _, p in rows])
    for (prompt, params), problem in zip(rows, got):
        try:
            engine.check_request(prompt, params)
            expected = None
        except ValueError as e:
            expected = str(e)
        assert problem == expected, (prompt, params)
    assert got[0] is None and got[6] is None and all(p is not None for p in got[1:6] + got[7:])
    padded = np.concatenate([[99, 99], flat, [99]])        # a slice of a larger buffer: offsets are absolute
    assert engine.check_requests(padded, offsets + 2, [p for _, p in rows]) == got


def test_with_seed_keeps_every_setting_and_checks_the_seed():
    base = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, stop=("\n",), logprobs=1)
    seeded = base.with_seed(42)
    assert seeded == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, stop=("\n",),
                                    logprobs=1, seed=42)
    assert base.seed is None and base.with_seed(None) == base
    for bad in (-1, 2 ** 63, "7"):
        with pytest.raises(ValueError, match="SamplingParams.seed"):
            base.with_seed(bad)
