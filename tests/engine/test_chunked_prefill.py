"""The token budget: prompts prefilled in chunks inside the running rows' forwards, exactly as when
each prompt is computed at once, and without stalling the rows that decode beside them."""
from __future__ import annotations

import numpy as np
import pytest

from orthrus import OrthrusEngine, SamplingParams
from support.tiny_models import hf_greedy, hf_twin, tiny_model

MODES = [True, False, "auto"]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7, diff_noise=0.4, scale=4.0, max_pos=512)


def _prompts(n: int, seed: int, low: int = 3, high: int = 150) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 60, int(rng.integers(low, high))).tolist() for _ in range(n)]


@pytest.mark.parametrize("speculative", MODES)
def test_chunked_prompts_greedy_equal_transformers(model, speculative):
    """A budget of 24 tokens: every long prompt is prefilled over several steps beside decoding rows,
    new rows are seated mid-flight, and every row is transformers' greedy decoding (float64)."""
    prompts = _prompts(7, seed=1)
    engine = OrthrusEngine(model, max_batch_size=3, max_seq_len=256, max_num_batched_tokens=24)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10), speculative=speculative)
    hf = hf_twin(model)
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(hf, prompt, 10, engine.eos_token_ids)
    assert engine.stats.prefill_token_slots == engine.stats.prefill_tokens   # chunks: no token twice, no pad


@pytest.mark.parametrize("speculative", [True, False])
def test_seeded_samples_do_not_depend_on_the_budget(model, speculative):
    """Chunking moves when a row starts, never its random draws: the same tokens at any budget,
    with shared prompts (n samples of one prompt, prompts sharing a prefix) and logprobs."""
    base = _prompts(3, seed=2, low=40, high=120)
    prompts = [base[0], base[0], base[0] + [5, 6, 7], base[1], base[1][:30] + [9, 9], base[2]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=i, logprobs=2 if i % 2 else None)
              for i in range(len(prompts))]

    def run(budget: int, prefix_cache: bool = True):
        engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=256, max_num_batched_tokens=budget,
                               prefix_cache=prefix_cache)
        return engine, [(o.token_ids, o.token_logprobs) for o in engine.generate(prompts, params, speculative=speculative)]
    big, want = run(4096)
    small, got = run(16)
    _, plain = run(16, prefix_cache=False)
    assert [t for t, _ in got] == [t for t, _ in want] == [t for t, _ in plain]
    for (_, a), (_, b), (_, c) in zip(got, want, plain):          # float64, shapes differ: last bits
        assert (a is None) == (b is None) == (c is None)
        assert a is None or np.allclose(a, b, rtol=1e-12, atol=0) and np.allclose(a, c, rtol=1e-12, atol=0)
    assert small.stats.prefix_cache_hit_tokens > 0                 # the shared prompts were shared
    # ... and computed once, chunked or not; a row sharing the prefix of a row still prefilling
    # computes from that row's last whole page (a partial page is copied only once it is filled)
    page = small.cache.page_size
    assert big.stats.prefill_tokens <= small.stats.prefill_tokens <= big.stats.prefill_tokens + page * len(prompts)


def test_a_long_prompt_does_not_stall_the_decoding_rows(model):
    """Seven rows decode; a 400-token prompt arrives with a budget of 64: it is prefilled over
    several steps, no step computes more than the budget plus the running rows' draft and verify
    blocks, and the seven rows emit tokens in every one of those steps."""
    engine = OrthrusEngine(model, max_batch_size=8, max_seq_len=512, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=60, min_tokens=60)
    running = [engine.add_request(p, params) for p in _prompts(7, seed=3, low=5, high=12)]
    for _ in range(3):
        engine.step()
    long = engine.add_request(np.random.default_rng(4).integers(1, 60, 400).tolist(), SamplingParams(max_new_tokens=4))
    k = engine.block_size
    prefill_steps = 0
    while engine.scheduler.requests[long].slot < 0 or engine.scheduler.table.count[engine.scheduler.requests[long].slot] == 0:
        before = engine.stats
        counts = engine.scheduler.table.count.copy()
        engine.step()
        spent = engine.stats - before
        assert spent.forward_token_slots <= 64 + 7 * 2 * k             # the budget + 7 rows' draft and verify
        slots = [engine.scheduler.requests[r].slot for r in running]
        assert (engine.scheduler.table.count[slots] > counts[slots]).all()   # every decoding row advanced
        prefill_steps += spent.prefill_token_slots > 0
    assert prefill_steps >= 400 // 64                                 # the prompt took several steps


@pytest.mark.parametrize("speculative", [True, False])
def test_preemption_while_prefilling_keeps_every_token(model, speculative, monkeypatch):
    """A KV pool of under two rows, prompts prefilled 8 tokens a step: a row is preempted in the
    middle of its prefill (running rows are, in tests/engine/test_paged_kv.py) and seated again;
    every row is still transformers' greedy decoding."""
    from orthrus.engine.host.scheduler import Scheduler
    preempted = []
    original = Scheduler._preempt

    def preempt(self, slot):
        preempted.append("prefilling" if self.prefilling.mask[slot] else "running")
        return original(self, slot)
    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    prompts = _prompts(6, seed=5, low=60, high=120)
    engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=160, kv_cache_tokens=256,
                           max_num_batched_tokens=8, prefix_cache=False)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40), speculative=speculative)
    assert "prefilling" in preempted
    hf = hf_twin(model)
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(hf, prompt, 40, engine.eos_token_ids)


@pytest.mark.parametrize("budget", [10_000, 40])
def test_rows_completing_together_out_of_seat_order_are_exact(model, budget):
    """Every slot filled at once, an identical prompt and a shared prefix among them: the identical
    prompt completes with the row it copies (out of seat order), and the first cycle runs over every
    slot in the same step; each row is still transformers' greedy decoding."""
    base = _prompts(6, seed=8, low=20, high=60)
    prompts = [base[0], base[1], base[2], base[0], base[3], base[0][:16] + [7, 7, 7], base[4], base[5]]
    engine = OrthrusEngine(model, max_batch_size=len(prompts), max_seq_len=128, max_num_batched_tokens=budget)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    hf = hf_twin(model)
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(hf, prompt, 8, engine.eos_token_ids)
    assert engine.stats.prefix_cache_hit_tokens >= len(base[0]) + 16


def test_aborting_a_row_others_share_a_prefix_with_mid_prefill(model):
    """An identical prompt and a longer one share the pages of a row still prefilling (8 tokens a
    step); that row is aborted halfway: they compute their prompts on their own and still equal
    transformers' greedy decoding."""
    prompt = _prompts(1, seed=9, low=90, high=91)[0]
    engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=256, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    first = engine.add_request(prompt, params)
    same = engine.add_request(prompt, params)
    longer = engine.add_request(prompt[:60] + [3, 4, 5], params)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.prefilling.followers(engine.scheduler.requests[first].slot)
    engine.abort_request(first)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    hf = hf_twin(model)
    assert done[first].finish_reason == "abort"
    assert done[same].token_ids == hf_greedy(hf, prompt, 10, engine.eos_token_ids)
    assert done[longer].token_ids == hf_greedy(hf, prompt[:60] + [3, 4, 5], 10, engine.eos_token_ids)


def test_the_budget_is_checked():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 1"):
        OrthrusEngine(tiny_model(), max_num_batched_tokens=0)
