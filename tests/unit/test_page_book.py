"""The KV page pool's host book (``orthrus/engine/host/pages.py``) and the scheduler's per-step page
need (``Scheduler._make_room``), host only: ``PagePool.owned`` always equals each slot's page count;
after ``_make_room`` every running row holds its committed length plus one block; preempted rows
are the newest and wait oldest first (``PausedRows``), never older than a running row."""
from __future__ import annotations

import numpy as np

from orthrus.engine.host.admission import PausedRows, Seat
from orthrus.engine.host.grammar import SlotGrammars
from orthrus.engine.host.pages import PagePool
from orthrus.engine.host.prefix_cache import PageIndex, block_hashes
from orthrus.engine.host.requests import Request
from orthrus.engine.host.scheduler import Scheduler
from orthrus.engine.settings import EngineSettings
from orthrus.engine.step import ScheduledStep, StepOutput
from orthrus.params import SamplingParams

G, K = 16, 4


def _counts(pool: PagePool) -> list[int]:
    return [len(pages) for pages in pool.slot_pages]


def test_owned_follows_every_grow_share_release_and_reset():
    index = PageIndex(G)
    pool = PagePool(12, G, 4, 5, index)
    rng = np.random.default_rng(0)
    for _ in range(400):
        slot, op = int(rng.integers(4)), int(rng.integers(4))
        if op == 0 and pool.available() > 0:
            pool.grow(slot, min(pool.owned[slot] + int(rng.integers(1, 3)), 5, pool.owned[slot] + pool.available()))
        elif op == 1 and pool.owned[slot] == 0:
            donor = [p for p in pool.slot_pages[(slot + 1) % 4][:2] if p not in pool.cached]
            pool.share(slot, donor)
            if donor:
                prompt = rng.integers(1, 50, G * len(donor))
                index.add(prompt, block_hashes(prompt, G), donor)    # named: cached, not freed, at release
        elif op == 2:
            pool.release(slot)
        elif op == 3 and rng.random() < 0.05:
            pool.reset()
            index.clear()
        assert pool.owned.tolist() == _counts(pool)
        assert pool.in_use == int((pool.refs > 0).sum())


def test_pages_for_is_elementwise_and_capped_at_a_slot_table():
    pool = PagePool(8, G, 2, 3)
    assert pool.pages_for(np.asarray([0, 1, 16, 17, 48, 49, 500])).tolist() == [0, 1, 1, 2, 3, 3, 3]
    assert int(pool.pages_for(33)) == 3


def test_paused_rows_wait_first_preempted_last_in_line_and_mask_their_slots():
    paused = PausedRows(6)
    for slot in (5, 2, 4):                 # preempted newest first: each goes first in line
        paused.push(Seat(slot, np.zeros(1, dtype=np.int64), [], False))
    assert list(paused.seats) == [4, 2, 5] and paused.slots().tolist() == [2, 4, 5] and len(paused) == 3
    paused.pop(2)
    paused.pop(3)                          # not paused: no-op
    assert list(paused.seats) == [4, 5] and paused.mask.tolist() == [False] * 4 + [True, True]
    paused.clear()
    assert not paused and not paused.mask.any()


def _scheduler(rows: int, pages: int, prefix_cache: bool) -> Scheduler:
    settings = EngineSettings(max_batch_size=rows, block_size=K, max_seq_len=120, prefix_cache=prefix_cache,
                              max_num_batched_tokens=48)
    sched = Scheduler(settings, 64, SlotGrammars(None, 64, (0,), rows), None, pages, G)
    rng = np.random.default_rng(rows)
    shared = rng.integers(1, 60, 2 * G).tolist()
    for i in range(rows):
        prompt = (shared if i % 2 else []) + rng.integers(1, 60, int(rng.integers(3, 30))).tolist()
        sched.add(Request(str(i), prompt, SamplingParams(max_new_tokens=100, min_tokens=100), i))
    return sched


def _check_room(sched: Scheduler) -> None:
    running = sched._running()
    want = sched.pool.pages_for(sched.table.committed(running) + K)
    assert (sched.pool.owned[running] == want).all()
    assert sched.pool.owned.tolist() == _counts(sched.pool)
    paused = list(sched.paused.seats)
    assert sched.paused.slots().tolist() == sorted(paused) and not sched.pool.owned[paused].any()
    ages = sched.order[paused].tolist()
    assert ages == sorted(ages) and (not paused or not len(running) or min(ages) > sched.order[running].max())


def test_make_room_gives_each_running_row_its_next_block_and_preempts_the_newest():
    """Rows advance by 1 to K+1 tokens a step (as cycles do) over a pool of about two rows' pages
    and end (aborted) at 20 to 70 tokens: rows cross page boundaries, the newest are preempted and
    re-seated as others end (some end while paused), and the book stays exact at every step."""
    for prefix_cache in (True, False):
        sched = _scheduler(12, 2 * 8 + 1, prefix_cache)
        rng = np.random.default_rng(1)
        ends = rng.integers(20, 70, 12)
        while sched.has_unfinished():
            sched.schedule()
            _check_room(sched)
            sched.update(ScheduledStep(np.zeros(0, dtype=np.int64), None, None, np.zeros(0, dtype=np.int64), None),
                         StepOutput(None, 0.0))        # returns the aborted rows
            running = sched._running()
            sched.table.count[running] += rng.integers(1, K + 2, len(running))
            for slot in sched.table.occupied().tolist():
                req = sched.table.requests[slot]
                if sched.table.count[slot] >= ends[int(req.request_id)] or rng.random() < 0.01:
                    sched.abort(req.request_id)
        assert sched.stats.preemptions > 0 and sched.stats.recomputed_tokens > 0
        assert sched.pool.in_use == 0 and not sched.pool.owned.any() and not sched.paused
