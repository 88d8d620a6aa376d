"""Scheduler: the host side of the engine — the request queue, the slot table, what each step does.

``schedule()`` decides a step: which slots the device must mark dead (rows the host ended), which
waiting requests are seated (``admission.py``), the block size of the iteration over the live rows
(the mode, or the "auto" policy, ``policy.py``) and which rows only need their first token read.
``update(step, output)`` folds the step's one read into the slot table, advances the grammar
matchers, scans stop strings and returns the requests that finished. Host only: numpy and Python,
no torch. Per-row Python runs only over rows that are admitted or finish (events) and over rows
with stop strings or grammars, never over every row every step.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from orthrus.engine.host.admission import PausedRows, PromptPlanner, Seat, slot_params
from orthrus.engine.host.grammar import SlotGrammars
from orthrus.engine.host.pages import PagePool
from orthrus.engine.host.policy import SpeculationPolicy, halving_block_sizes
from orthrus.engine.host.prefix_cache import PageIndex, PrefixIndex, block_hashes
from orthrus.engine.host.requests import Request
from orthrus.engine.host.slot_table import SlotTable
from orthrus.engine.host.stop_strings import StopHit, StopStringScanner
from orthrus.engine.outputs import EngineStats, FinishReason, RequestOutput
from orthrus.engine.step import AR, Admission, Iteration, ScheduledStep, StepOutput
from orthrus.params import RowStats


class Scheduler:
    """Requests, slots and the host bookkeeping of one engine (``capacity``: a slot's cache positions).

    ``mode``: True (cycles of ``block_size``), False (AR steps) or "auto" (the policy's choice).
    ``num_pages`` KV pages of ``page_size`` tokens (page 0 the null page) back the slots' K/V:
    before each step every running row gets pages for its committed length plus one block, the
    newest rows giving theirs back (preempted) when the pool is short (``_make_room``)."""

    def __init__(self, num_slots: int, block_size: int, max_seq_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], grammars: SlotGrammars, stops: StopStringScanner | None,
                 prefix_cache: bool, mode: bool | str, num_pages: int, page_size: int) -> None:
        self.num_slots, self.block_size, self.max_seq_len, self.vocab_size = num_slots, block_size, max_seq_len, vocab_size
        self.capacity = max_seq_len + block_size
        self.eos_token_ids, self.grammars, self.stops = eos_token_ids, grammars, stops
        self.mode: bool | str = mode
        # The policy outlives requests: costs are a property of this engine on this device,
        # acceptance of this model on this workload.
        self.policy: SpeculationPolicy | None = None     # created by the first "auto" step
        # The prefix cache (prefix_cache.py): whole prompt pages by hash, running slots by prompt.
        self.page_index = PageIndex(page_size) if prefix_cache else None
        self.prefix_index = PrefixIndex(page_size) if prefix_cache else None
        self.pool = PagePool(num_pages, page_size, num_slots, -(-self.capacity // page_size), self.page_index)
        self.planner = PromptPlanner(self.pool, self.page_index, self.prefix_index, self.capacity, block_size)
        self.paused = PausedRows(num_slots)          # preempted rows, what re-seats them (oldest first)
        self.order = np.zeros(num_slots, dtype=np.int64)   # when each slot's row was admitted (newest: largest)
        self._admissions = 0
        self.table = SlotTable(num_slots, block_size, max_seq_len, vocab_size)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}       # every unfinished request, by id
        self.stats = EngineStats()
        self._done: list[RequestOutput] = []        # finished outside an iteration (aborted): next update
        self._aborted_slots: list[int] = []         # running requests aborted: released next schedule
        self._ended: list[int] = []                 # slots the host ended whose rows the device still runs

    def add(self, req: Request) -> None:
        """Queue a checked request (its id is unused)."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """End a waiting or running request (returned once by the next update). Unknown ids: no-op."""
        req = self.requests.get(request_id)
        if req is None or req.abort:
            return
        req.abort = True
        if req.slot >= 0:
            self._aborted_slots.append(req.slot)
        else:
            self.waiting.remove(req)
            del self.requests[request_id]
            self._done.append(req.output([], FinishReason.ABORT, None, RowStats(0, 0, 0, 0)))

    def has_unfinished(self) -> bool:
        """Requests are waiting, decoding, or finished and not yet returned."""
        return bool(self.requests) or bool(self._done)

    def reset(self) -> None:
        """Drop every request and empty every slot (the policy and its measurements stay)."""
        self.waiting.clear()
        self.requests.clear()
        self._done.clear()
        self._aborted_slots.clear()
        self._ended.clear()
        self.paused.clear()
        for index in (self.page_index, self.prefix_index):
            if index is not None:
                index.clear()
        self.pool.reset()
        self.table = SlotTable(self.num_slots, self.block_size, self.max_seq_len, self.vocab_size)
        self.grammars.reset()

    def schedule(self) -> ScheduledStep:
        """Decide one step: release aborted slots, give running rows their pages (preempting the
        newest if the pool is short), re-seat preempted rows, then seat waiting requests in free
        slots (FIFO), and plan one iteration over the running slots that can still generate."""
        for slot in self._aborted_slots:
            self._done.append(self._output(slot, FinishReason.ABORT, None))
        kill = np.asarray(self._ended + self._aborted_slots, dtype=np.int64)
        self._ended, self._aborted_slots = [], []
        self._make_room()
        adm = self._admit() if self.paused or (self.waiting and not self.table.busy_mask.all()) else None
        slots = self._running()
        remaining = self.table.remaining(slots)
        # (a constrained row's masks need its first token on the host: it sits its first step out;
        # so does one whose grammar failed at admission, which ends at the update)
        settle = (remaining <= 0) | self.grammars.awaiting_first(slots, self.table.count)
        if self.grammars.failed:
            settle |= np.isin(slots, list(self.grammars.failed))
        live = slots[~settle]
        it = self._iteration(live, int(remaining.max())) if len(live) else None
        return ScheduledStep(kill, adm, it, slots[settle], self.table.logprobs.width(slots), self.pool.take_entries(),
                             self.paused.slots())

    def _running(self) -> np.ndarray:
        """Occupied slots that are not paused (preempted), ascending."""
        return np.flatnonzero(self.table.busy_mask & ~self.paused.mask)

    def _iteration(self, live: np.ndarray, remaining: int) -> Iteration:
        """One cycle or AR step over the ``live`` rows (``remaining``: the most tokens any occupied row may still take)."""
        chosen, paths = self._choose_block(len(live)), self.table.paths(live)
        # A block longer than any row can still accept is wasted work. Capping it changes a sampled
        # row's random draws (the draft block's length is part of them), so a seeded row would
        # depend on its batch-mates' budgets; greedy rows are the same tokens at any block size,
        # and "auto" already picks the size by occupancy.
        block = _cap_block(chosen, remaining) if paths.all_greedy or self.mode == "auto" else chosen
        constrained = self.grammars.any(live)
        return Iteration(block, live, self.table.kv_len(live), paths,
                         first_masks=self.grammars.first[live] if constrained else None,
                         grammar=self.grammars if constrained else None,
                         arm=chosen if self.mode == "auto" and block == chosen else None)   # a capped block measures no arm

    def _choose_block(self, occupancy: int) -> int:
        """This iteration's block size by the mode: K, AR, or the "auto" policy's choice."""
        if self.mode != "auto":
            return self.block_size if self.mode else AR
        if self.policy is None:
            self.policy = SpeculationPolicy(halving_block_sizes(self.block_size))
        return self.policy.choose(occupancy)

    def _make_room(self) -> None:
        """Every running row gets pages for its committed length plus one block (what this step may
        write). When the pool cannot give them, the newest rows are preempted: they give their pages
        back and keep their slot and device state (sampling position, stop state), to be re-seated
        (their K/V recomputed) when pages free up. The need is array code over the running rows;
        Python runs only over rows that cross a page boundary or are preempted (events)."""
        slots = self._running()
        want = self.pool.pages_for(self.table.committed(slots) + self.block_size)
        need = np.maximum(want - self.pool.owned[slots], 0)
        if int(need.sum()) > self.pool.available() and len(slots) > 1:
            kept = self._preempt_newest(slots, need)
            slots, want, need = slots[kept], want[kept], need[kept]
        grow = np.flatnonzero(need)
        for slot, total in zip(slots[grow].tolist(), want[grow].tolist()):  # SYNC: none (host numpy)
            self.pool.grow(slot, total)

    def _preempt_newest(self, slots: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Preempt the newest of ``slots`` until the others' ``need`` of pages fits the pool → a mask
        of the rows kept. The oldest row always stays, and fits: the pool holds one row at full
        length (checked by the engine)."""
        kept = np.ones(len(slots), dtype=bool)
        total = int(need.sum())
        for i in np.argsort(self.order[slots])[:0:-1].tolist():   # newest first, all but the oldest
            if total <= self.pool.available():
                break
            kept[i] = False
            total -= int(need[i])
            self._preempt(int(slots[i]))
        return kept

    def _preempt(self, slot: int) -> None:
        """Take ``slot``'s pages back; it waits (first in line) to have its K/V recomputed."""
        first = next(iter(self.paused.seats), None)
        assert first is None or self.order[slot] < self.order[first], "a paused row is older than a running one"
        n = int(self.table.committed(np.asarray([slot]))[0])
        req = self.table.requests[slot]
        tokens = np.concatenate([req.prompt_ids, self.table.generated(slot)[: n - len(req.prompt)]])
        hashes = block_hashes(tokens, self.pool.page_size) if self.page_index is not None else []
        self.paused.push(Seat(slot, tokens, hashes, new=False))
        self.pool.release(slot)
        if self.prefix_index is not None:
            self.prefix_index.remove(slot)
        self.stats += EngineStats(preemptions=1)

    def _admit(self) -> Admission | None:
        """Re-seat preempted rows (oldest first), then seat waiting requests in free slots (FIFO),
        as far as the page pool allows; plan their prefill, sharing every prompt prefix a page or a
        running slot holds (the prefix cache) instead of computing it."""
        free = self.table.free_slots()
        waiting = [self.waiting[i] for i in range(min(len(self.waiting), len(free)))]
        for r in waiting:
            if r.prefix_hashes is None:
                r.prefix_hashes = block_hashes(r.prompt_ids, self.pool.page_size) if self.page_index is not None else []
        seats = list(self.paused.seats.values()) + [Seat(int(s), r.prompt_ids, r.prefix_hashes, True)
                                                    for s, r in zip(free.tolist(), waiting)]  # SYNC: none (host numpy)
        plan = self.planner.plan(seats)
        if plan.seated == 0:
            return None
        resumed = [s.slot for s in seats[: plan.seated] if not s.new]
        for slot in resumed:
            self.paused.pop(slot)
        reqs = [self.waiting.popleft() for _ in range(plan.seated - len(resumed))]
        slots = free[: len(reqs)]
        now = time.perf_counter()
        for slot, r in zip(slots.tolist(), reqs):  # SYNC: none (host numpy)
            r.admitted = now
            self._admissions += 1
            self.order[slot] = self._admissions
        self.table.admit(slots, reqs)
        masks = self.grammars.admit(slots, [r.params.structured for r in reqs], [r.reasoning is not None for r in reqs])
        held = sum(len(r.prompt) for r in reqs) - plan.computed
        self.stats += EngineStats(admitting_steps=1, prefill_tokens=plan.computed, prefix_cache_hit_tokens=held,
                                  recomputed_tokens=plan.recomputed)
        return Admission(slots, np.asarray([len(r.prompt) for r in reqs], dtype=np.int64),
                         slot_params(reqs, self.eos_token_ids), plan.stages, masks, self.table.prefill_paths(slots),
                         self.table.logprobs.width(slots), np.asarray(resumed, dtype=np.int64))

    def update(self, step: ScheduledStep, out: StepOutput) -> list[RequestOutput]:
        """Fold a step's read into the host book → the requests that finished (rows the host ends
        here, by a stop string or a failed grammar, are marked dead by the next step)."""
        done, self._done = self._done, []
        if out.packed is None:
            return done
        it, rows = step.iteration, step.rows
        if it is not None:
            self.stats += EngineStats(iterations=1, busy_slot_iterations=len(it.slots), page_iterations=self.pool.in_use)
        rec = self.table.record(rows, out.packed, it.block if it is not None else AR)
        if self.grammars.any(rows):
            self.grammars.advance(rows, self.table.generated)
        if it is not None and it.arm is not None:
            self.policy.observe(it.arm, len(it.slots), time.perf_counter() - out.started, rec.tokens, rec.live)
        ended = dict(zip(rec.finished.tolist(), rec.reasons.tolist()))  # SYNC: none (host numpy)
        hits = self._scan_stops(rows)
        failed = self.grammars.take_failed()      # rows whose own grammar failed: they end in error
        for s in failed:
            hits.pop(s, None)
        self._ended += [s for s in (*hits, *failed) if s not in ended]
        return done + [self._output(s, FinishReason.ERROR, None, failed[s]) if s in failed else
                       self._output(s, FinishReason(ended.get(s, FinishReason.STOP)), hits.get(s))
                       for s in sorted(set(ended) | set(hits) | set(failed))]

    def _scan_stops(self, slots: np.ndarray) -> dict[int, StopHit]:
        """Stop strings found this iteration, by slot (only rows that have stop strings are decoded)."""
        hits: dict[int, StopHit] = {}
        for slot in slots[self.table.has_stops[slots]].tolist():  # SYNC: none (host numpy)
            req, tokens = self.table.requests[slot], self.table.generated(slot)
            if len(tokens) > req.scanned:
                hit = self.stops.scan(tokens, req.scanned, req.params.stop)
                req.scanned = len(tokens)
                if hit is not None:
                    hits[slot] = hit
        return hits

    def _output(self, slot: int, reason: FinishReason, hit: StopHit | None, error: str | None = None) -> RequestOutput:
        """Free ``slot`` and build its request's output (``error``: why it ended in error)."""
        rel = self.table.release(slot, *((hit.keep, hit.end) if hit else ()))
        req, tokens = rel.request, rel.tokens
        lp = self.table.logprobs.release(slot, len(tokens))
        del self.requests[req.request_id]
        self.grammars.release(slot)
        # Its pages go back (whole prompt pages stay cached for later prompts sharing them).
        self.pool.release(slot)
        self.paused.pop(slot)
        if self.prefix_index is not None:
            self.prefix_index.remove(slot)
        if hit is not None:
            return req.output(tokens, FinishReason.STOP, hit.stop, rel.stats, hit.text, lp)
        stop_reason = tokens[-1] if reason == FinishReason.STOP and tokens else None
        text = self.stops.completion(tokens, stop_reason is not None) if self.stops is not None else None
        return req.output(tokens, reason, stop_reason, rel.stats, text, lp, error=error)


def _cap_block(block: int, remaining: int) -> int:
    """A block never longer than the rows can still accept: a cycle of K emits at most K tokens, so
    with at most ``remaining`` left anywhere K shrinks to it (an AR step when one token is left)."""
    if block == AR or remaining >= block:
        return block
    return remaining if remaining >= 2 else AR
