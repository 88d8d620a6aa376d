"""Prefix cache: prompts that share leading tokens with a prompt some slot holds copy its K/V and
prefill only the rest, and every token is what the engine computes without the cache."""
from __future__ import annotations

import numpy as np
import pytest

from orthrus import OrthrusEngine, SamplingParams
from orthrus.engine.host.policy import AR, SpeculationPolicy, halving_block_sizes
from orthrus.engine.host.prefix_cache import PageIndex, PrefixIndex, block_hashes
from support.tiny_models import hf_greedy, hf_twin, tiny_model

PREFIX = np.random.default_rng(3).integers(1, 60, 37).tolist()   # no EOS (63) in any prompt


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, diff_noise=0.3, scale=4.0)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: the shared 37-token prefix, then 2–12 tokens of their own."""
    rng = np.random.default_rng(seed)
    return [PREFIX + rng.integers(1, 60, rng.integers(2, 13)).tolist() for _ in range(n)]


def _idx(prompt: list[int], index: PrefixIndex):
    a = np.asarray(prompt, dtype=np.int64)
    return index.match(a, block_hashes(a, index.block))


def test_index_finds_the_longest_held_prefix():
    index = PrefixIndex(block=4)
    long, other = list(range(1, 21)), [9] * 12
    index.add(0, np.asarray(long, dtype=np.int64))
    index.add(1, np.asarray(other, dtype=np.int64))
    m = _idx(long[:10] + [50, 51], index)
    assert (m.slot, m.length, m.whole) == (0, 10, False)     # extended token by token past block 2
    m = _idx(long, index)
    assert (m.slot, m.length, m.whole) == (0, 20, True)      # identical: nothing to compute
    m = _idx(long[:13], index)
    assert (m.slot, m.length, m.whole) == (0, 12, False)     # a prefix of the holder: last token computed
    assert _idx([1, 2, 3, 50, 6], index) is None              # under one whole block
    assert _idx(other[:3], index) is None
    index.remove(0)
    assert _idx(long, index) is None and 1 in index and 0 not in index
    index.add(1, np.asarray(long, dtype=np.int64))            # a slot refilled forgets its old prompt
    assert _idx(other, index) is None and _idx(long, index).slot == 1


class FixedCostPolicy(SpeculationPolicy):
    """"auto" with set costs (an AR step 1, a k-block cycle 1 + k/8) in place of measured ones: its
    choices then follow the tokens alone, so two runs that must agree make the same choices. (A
    seeded sampled row's draws depend on the block sizes chosen; measured costs differ between runs.)"""

    def observe(self, arm: int, occupancy: int, seconds: float, tokens: int = 0, live_rows: int = 0) -> None:
        super().observe(arm, occupancy, 1.0 + arm / 8, tokens, live_rows)


def _run(model, prompts, params, **kw):
    # every draft verified: under "auto" a sampled row's verify budget follows measured times too
    engine = OrthrusEngine(model, adaptive_verify=False, **kw)
    if kw.get("speculative") == "auto":
        engine.scheduler.speculation.policy = FixedCostPolicy(halving_block_sizes(engine.block_size))
    return engine, [(r.token_ids, r.finish_reason) for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_shared_prefix_tokens_equal_no_cache(model, speculative, temperature):
    """10 prompts sharing 37 tokens through 4 slots: the first admission computes the prefix once
    (stage 2 copies it), later ones copy it from running or freed slots; tokens equal no cache."""
    prompts = _prompts(10)
    params = [SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, max_new_tokens=6 + 3 * i,
                             seed=i) for i in range(len(prompts))]
    cached, got = _run(model, prompts, params, max_batch_size=4, speculative=speculative)
    plain, want = _run(model, prompts, params, max_batch_size=4, speculative=speculative, prefix_cache=False)
    assert got == want
    if speculative == "auto":     # it did switch: AR steps and cycles both ran
        assert cached.scheduler.speculation.policy.chosen == plain.scheduler.speculation.policy.chosen and cached.scheduler.speculation.policy.chosen[AR] > 0
        assert sum(cached.scheduler.speculation.policy.chosen.values()) > cached.scheduler.speculation.policy.chosen[AR]
    rest = sum(len(p) - len(PREFIX) for p in prompts)
    assert plain.stats.prefill_tokens == sum(len(p) for p in prompts) and plain.stats.prefix_cache_hit_tokens == 0
    # the prefix is computed once; each row computes its own part (plus at most one block's leftover)
    assert cached.stats.prefill_tokens <= len(PREFIX) + rest + len(prompts) * 16
    assert cached.stats.prefill_tokens + cached.stats.prefix_cache_hit_tokens == plain.stats.prefill_tokens
    assert cached.stats.prefix_cache_hit_tokens >= (len(prompts) - 1) * 32


def test_greedy_with_prefix_cache_equals_transformers(model):
    prompts = _prompts(5, seed=1)
    engine = OrthrusEngine(model, max_batch_size=2)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    hf = hf_twin(model)
    for p, r in zip(prompts, got):
        assert r.token_ids == hf_greedy(hf, p, 12, model.eos_token_ids)
    assert engine.stats.prefix_cache_hit_tokens > 0


def test_requests_added_mid_flight_copy_from_running_slots(model):
    """Requests added while others decode copy the prefix from a running slot (stage 1)."""
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.7, max_new_tokens=20, seed=5)
    engine = OrthrusEngine(model, max_batch_size=6)
    engine.add_request(prompts[0], params, request_id="0")
    out = {o.request_id: o for o in engine.step()}
    computed = engine.stats.prefill_tokens
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(p, params, request_id=str(i))
        out.update((o.request_id, o) for o in engine.step())
    while engine.has_unfinished_requests():
        out.update((o.request_id, o) for o in engine.step())
    assert engine.stats.prefill_tokens - computed < sum(len(p) for p in prompts[1:]) - 5 * 32
    for i, p in enumerate(prompts):
        alone = OrthrusEngine(model, max_batch_size=1, prefix_cache=False).generate([p], params)[0]
        assert out[str(i)].token_ids == alone.token_ids


def test_a_forward_that_would_pass_a_slot_is_split(model):
    """One row resumes at position 32 (two whole cached pages of a finished prompt) with a short
    rest, another computes 50 tokens from 0: padded together they would write past the 60-token
    slot, so they run as two forwards, still exact."""
    held = PREFIX + [5, 6, 7, 8]
    long_rest = [int(t) for t in np.random.default_rng(4).integers(1, 60, 50)]
    prompts = [held, held[:40] + [9, 10, 11], long_rest]
    params = SamplingParams(max_new_tokens=8)
    engine = OrthrusEngine(model, max_batch_size=3, max_seq_len=56)
    engine.generate([held], params)                         # its whole prompt pages stay cached
    got = [r.token_ids for r in engine.generate(prompts[1:], params)]
    ref = OrthrusEngine(model, max_batch_size=3, max_seq_len=56, prefix_cache=False)
    assert got == [r.token_ids for r in ref.generate(prompts[1:], params)]
    # whole pages only: the finished row's partial page (positions 32-40) went back to the pool
    assert engine.stats.prefix_cache_hit_tokens == 32


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_static_shapes_never_reuse_freed_slots(model, static):
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=1)
    engine, got = _run(model, prompts, params, max_batch_size=2, static_shapes=static)
    _, want = _run(model, prompts, params, max_batch_size=2, static_shapes=static, prefix_cache=False)
    assert got == want
    assert engine.stats.prefix_cache_hit_tokens > 0


def test_page_index_matches_whole_pages_checked_token_by_token():
    index = PageIndex(block=4)
    prompt = np.arange(1, 14, dtype=np.int64)                         # 3 whole pages + 1 token
    hashes = block_hashes(prompt, 4)
    index.add(prompt, hashes, [7, 8, 9])
    assert index.match(prompt, hashes, limit=3) == [7, 8, 9]
    assert index.match(prompt, hashes, limit=2) == [7, 8]               # the caller's cap (last token computed)
    other = prompt.copy()
    other[5] = 99                                                       # differs in page 1
    assert index.match(other, block_hashes(other, 4), limit=3) == [7]
    assert index.match(other, hashes, limit=3) == [7]                   # a "collision": page 1's tokens differ
    index.forget(8)                                                     # evicted: the chain stops there
    assert index.match(prompt, hashes, limit=3) == [7] and 8 not in index and 9 in index


def test_page_pool_counts_references_caches_indexed_pages_and_evicts_the_oldest():
    from orthrus.engine.host.pages import PagePool
    index, prompt = PageIndex(16), np.arange(1, 33)
    index.add(prompt, block_hashes(prompt, 16), [1, 2])                # pages 1, 2 hold a prompt's two pages
    pool = PagePool(5, 16, 3, 4, index)
    assert pool.grow(0, 2) == [1, 2] and pool.available() == 2
    pool.share(1, [1, 2])                                               # slot 1 shares slot 0's prompt pages
    pool.grow(1, 3)
    assert pool.refs[[1, 2, 3]].tolist() == [2, 2, 1] and pool.in_use == 3
    pool.release(0)
    assert pool.refs[[1, 2]].tolist() == [1, 1] and pool.in_use == 3
    pool.release(1)                                                     # 1, 2 cached (named); 3 free
    assert list(pool.cached) == [2, 1] and list(pool.free) == [4, 3] and pool.in_use == 0 and pool.peak == 3
    assert pool.grow(2, 3) == [4, 3, 2] and 2 not in index and 1 in index   # free first, then the oldest cached
    entries = pool.take_entries()
    assert entries.shape[1] == 3 and len({(s, e) for s, e, _ in entries.tolist()}) == len(entries)
    assert [p for s, e, p in entries.tolist() if s == 0] == [0, 0]      # released: the null page
