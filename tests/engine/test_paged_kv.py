"""The paged KV cache: a pool too small for every row preempts the newest rows and recomputes their
K/V later, and every row still ends with exactly the tokens (and logprobs) of a run that never
preempted; pages are held in proportion to rows' tokens; no forward writes a page another row
holds, and cached prefix pages never change (float64, the tiny model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from support.tiny_models import tiny_model

SHARED = [int(t) for t in np.random.default_rng(11).integers(1, 60, 35)]   # 2 whole pages + 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, diff_noise=0.3, scale=3.0)


def _workload(n: int = 7) -> tuple[list[list[int]], list[SamplingParams]]:
    """Rows of 5–40 prompt tokens (some sharing a 35-token prefix, two identical), 24–40 new tokens
    each (min_tokens keeps them from stopping early), greedy and seeded sampled, logprobs on some."""
    rng = np.random.default_rng(5)
    prompts = [SHARED + rng.integers(1, 60, 5).tolist() if i % 3 == 0 else rng.integers(1, 60, rng.integers(5, 30)).tolist()
               for i in range(n)]
    prompts[1] = prompts[0]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=i, max_new_tokens=24 + 2 * i,
                             min_tokens=24 + 2 * i, logprobs=2 if i % 3 == 1 else None) for i in range(n)]
    return prompts, params


def _run(model, prompts, params, **kw) -> tuple[OrthrusEngine, list]:
    engine = OrthrusEngine(model, max_batch_size=len(prompts), max_seq_len=80, **kw)
    return engine, engine.generate(prompts, params)


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        if w.token_logprobs is not None:
            np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, rtol=0, atol=1e-9)
            assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in w.top_logprobs]


SLOW = pytest.mark.slow      # the fast tier keeps eager spec and AR; the slow one every mode x path


@pytest.mark.parametrize("speculative, static", [
    (True, False), (False, False), pytest.param("auto", False, marks=SLOW), pytest.param(True, True, marks=SLOW),
    pytest.param(False, True, marks=SLOW), pytest.param("auto", True, marks=SLOW)],
    ids=["eager-spec", "eager-ar", "eager-auto", "static-spec", "static-ar", "static-auto"])
def test_preempted_rows_end_with_the_tokens_of_an_unpreempted_run(model, speculative, static):
    """7 rows in flight over a pool of 1.5 full-length rows' pages: rows are preempted and recomputed,
    tokens and logprobs equal a pool that holds every row (prefix cache on in both)."""
    prompts, params = _workload()
    roomy, want = _run(model, prompts, params, speculative=speculative, static_shapes=static)
    tight, got = _run(model, prompts, params, speculative=speculative, static_shapes=static, kv_cache_tokens=96 + 48)
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions > 0 and tight.stats.recomputed_tokens > 0
    if speculative != "auto":          # "auto" chooses by measured costs: its seeded rows may differ in draws
        _same(got, want)
    else:
        _same([g for g, p in zip(got, params) if p.greedy], [w for w, p in zip(want, params) if p.greedy])
    assert tight.kv_pages.peak <= tight.kv_pages.total and tight.kv_pages.in_use == 0


def test_paged_equals_the_static_layout_without_a_prefix_cache(model):
    """A pool of scattered pages (every row's pages interleaved with others') gives the tokens of the
    engine's default pool, with requests added while others decode."""
    prompts, params = _workload(5)
    _, want = _run(model, prompts, params, prefix_cache=False)
    engine = OrthrusEngine(model, max_batch_size=5, max_seq_len=80, prefix_cache=False, kv_cache_tokens=96 + 48)
    engine.scheduler.pool.free.rotate(7)              # pages handed out out of order
    done = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=str(i))
        done.update((o.request_id, o) for o in engine.step())
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    _same([done[str(i)] for i in range(5)], want)
    assert engine.stats.preemptions > 0


def test_no_forward_writes_a_page_another_row_holds_and_cached_pages_never_change(model):
    """Checked at every cache write (no page that two rows held at the end of the last step, and
    still hold, is written, nor a page the prefix index named then and still names: a page is
    written by its one owner, or computed in the step that first shares it, in stage 1 before its
    sharers read it) and after every step (every page the prefix index names keeps the K/V it had
    when first seen)."""
    prompts, params = _workload(9)
    engine = OrthrusEngine(model, max_batch_size=5, max_seq_len=80, kv_cache_tokens=96 + 48, static_shapes=True)
    sched, cache = engine.scheduler, engine.cache
    pool, index, write = sched.pool, sched.page_index, cache.write

    def holders() -> dict[int, set[tuple[int, int]]]:
        out: dict[int, set[tuple[int, int]]] = {}
        for slot, pages in enumerate(pool.slot_pages):
            for page in pages:
                out.setdefault(page, set()).add((slot, int(sched.order[slot])))
        return out
    shared: dict[int, set] = {}
    named: dict[int, int] = {}         # page -> its prefix hash, at the end of the last step

    def checked(layer, flat, k, v):
        now = holders()
        for page in np.unique((flat // cache.page_size).numpy()).tolist():
            assert not (page in shared and shared[page] <= now.get(page, set())), f"a write to shared page {page}"
            assert not (page in named and index._of_page.get(page, (None,))[0] == named[page]), f"a write to cached page {page}"
        write(layer, flat, k, v)
    cache.write = checked
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=str(i))
    while engine.has_unfinished_requests():
        engine.step()
        shared = {page: rows for page, rows in holders().items() if len(rows) > 1}
        named = {page: h for page, (h, _) in index._of_page.items()}
        for page, (h, _) in index._of_page.items():
            now = cache.k[0][page].clone()
            torch.testing.assert_close(seen.setdefault((page, h), now), now, rtol=0, atol=0)
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hit_tokens > 0 and len(seen) >= 2


def test_rows_hold_pages_in_proportion_to_their_tokens(model):
    """Short and long rows: after admission each holds ceil((prompt + block) / 16) pages, and 12
    short rows run at once in a pool the static layout would give 3 rows of this context."""
    lengths = [3, 17, 40, 70]
    engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=120)
    for i, n in enumerate(lengths):
        engine.add_request([i + 1] * n, SamplingParams(max_new_tokens=20, min_tokens=20), request_id=str(i))
    engine.step()
    want = [-(-(n + engine.block_size) // 16) for n in lengths]          # [1, 2, 3, 5]
    assert engine.scheduler.pool.owned.tolist() == want and engine.kv_pages.in_use == sum(want)
    pool = 3 * 128                                         # 3 rows at full length (120 + 4, in whole pages)
    many = OrthrusEngine(model, max_batch_size=12, max_seq_len=120, kv_cache_tokens=pool, prefix_cache=False)
    for i in range(12):
        many.add_request([i + 1] * 6, SamplingParams(max_new_tokens=8, min_tokens=8), request_id=str(i))
    outs = many.step()
    assert many.num_running == 12 and many.num_waiting == 0          # 4x the static layout's 3 rows
    while many.has_unfinished_requests():
        outs += many.step()
    assert sorted(len(o.token_ids) for o in outs) == [8] * 12 and many.stats.preemptions == 0


def test_a_pool_smaller_than_one_row_is_refused(model):
    with pytest.raises(ValueError, match=r"kv_cache_tokens must be an int >= 96 \(one row at full length"):
        OrthrusEngine(model, max_batch_size=2, max_seq_len=80, kv_cache_tokens=80)


def test_preempted_constrained_rows_keep_their_grammar_state():
    """Grammar rows (JSON schema, regex, choice) and free ones with the bundled tokenizer's
    vocabulary, 6 rows over a pool of about one row: preempted rows resume with their matcher
    untouched, tokens equal a roomy pool's, sampled and greedy."""
    from transformers import AutoTokenizer
    from support.constraints import PERSON, PROMPTS
    from support.paths import TOKENIZER_DIR
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model = tiny_model(seed=5, vocab=4097, eos=[4095, 4093], block_size=4, diff_noise=0.5, scale=20.0)
    kinds = [{"json_schema": PERSON}, {"regex": r"[a-z]{1,5}( [a-z]{1,5}){0,2}\."}, {"choice": ["yes", "no"]}, None]
    prompts = [PROMPTS[i % len(PROMPTS)] * 6 for i in range(6)]
    params = [SamplingParams(temperature=0.7 * (i % 2), seed=i, max_new_tokens=24, structured=kinds[i % 4],
                             min_tokens=0 if kinds[i % 4] else 24) for i in range(6)]
    runs = []
    for pool in (None, 48 + 16):
        engine = OrthrusEngine(model, max_batch_size=6, max_seq_len=60, tokenizer=tok, kv_cache_tokens=pool)
        runs.append((engine, engine.generate(prompts, params)))
    (roomy, want), (tight, got) = runs
    _same(got, want)
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions > 0
