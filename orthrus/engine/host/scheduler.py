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
from dataclasses import replace

import numpy as np

from orthrus.engine.host.admission import PausedRows, PromptPlanner, Seat, attention_groups
from orthrus.engine.host.grammar import SlotGrammars
from orthrus.engine.host.pages import PagePool
from orthrus.engine.host.prefilling import Prefilling
from orthrus.engine.host.prefix_cache import PageIndex, PrefixIndex, block_hashes
from orthrus.engine.host.requests import Request
from orthrus.engine.host.slot_table import Recorded, SlotTable
from orthrus.engine.host.speculation import Speculation
from orthrus.engine.host.stop_strings import StopHit, StopStringScanner
from orthrus.engine.outputs import EngineStats, FinishReason, RequestOutput
from orthrus.engine.row_settings import seen_prompts, slot_params
from orthrus.engine.settings import EngineSettings
from orthrus.engine.step import AR, Admission, Iteration, PrefillWork, ScheduledStep, StepOutput
from orthrus.params import RowStats


_NONE = np.zeros(0, dtype=np.int64)


class Scheduler:
    """Requests, slots and the host bookkeeping of one engine (``capacity``: a slot's cache positions).

    ``mode``: True (cycles of ``block_size``), False (AR steps) or "auto" (the policy's choice).
    ``num_pages`` KV pages of ``page_size`` tokens (page 0 the null page) back the slots' K/V:
    before each step every running row gets pages for its committed length plus one block, the
    newest rows giving theirs back (preempted) when the pool is short (``_make_room``)."""

    def __init__(self, settings: EngineSettings, vocab_size: int, grammars: SlotGrammars,
                 stops: StopStringScanner | None, num_pages: int, page_size: int) -> None:
        """For resolved ``settings`` (``EngineSettings.resolved``), over ``num_pages`` KV pages."""
        num_slots, block_size, max_seq_len = settings.max_batch_size, settings.block_size, settings.max_seq_len
        prefix_cache, mode, adaptive_verify = settings.prefix_cache, settings.speculative, settings.adaptive_verify
        self.num_slots, self.block_size, self.max_seq_len, self.vocab_size = num_slots, block_size, max_seq_len, vocab_size
        self.capacity = max_seq_len + block_size
        self.grammars, self.stops = grammars, stops
        # The block size and verify share of each iteration, and the policies that choose them.
        self.speculation = Speculation(block_size, mode, adaptive_verify)
        # The prefix cache (prefix_cache.py): whole prompt pages by hash, running slots by prompt.
        self.page_index = PageIndex(page_size) if prefix_cache else None
        self.prefix_index = PrefixIndex(page_size) if prefix_cache else None
        self.pool = PagePool(num_pages, page_size, num_slots, -(-self.capacity // page_size), self.page_index)
        self.planner = PromptPlanner(self.pool, self.page_index, self.prefix_index, self.capacity, block_size)
        self.paused = PausedRows(num_slots)          # preempted rows, what re-seats them (oldest first)
        # Seated rows still computing their K/V, in chunks within each step's token budget, and (with
        # the prefix cache) the new ones among them by prompt: a seat sharing their prefix shares
        # their pages and computes after them (admission.py).
        self.budget = settings.max_num_batched_tokens
        self.prefilling = Prefilling(num_slots)
        self.pending = PrefixIndex(page_size) if prefix_cache else None
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
        self.prefilling.clear()
        for index in (self.page_index, self.prefix_index, self.pending):
            if index is not None:
                index.clear()
        self.pool.reset()
        self.table = SlotTable(self.num_slots, self.block_size, self.max_seq_len, self.vocab_size)
        self.grammars.reset()

    def schedule(self) -> ScheduledStep:
        """Decide one step: release aborted slots, give running rows their pages (preempting the
        newest if the pool is short), re-seat preempted rows, then seat waiting requests in free
        slots (FIFO), plan one iteration over the running slots that can still generate, and spend
        what is left of the token budget on prefilling rows' chunks."""
        for slot in self._aborted_slots:
            self._done.append(self._output(slot, FinishReason.ABORT, None))
        kill = np.asarray(self._ended + self._aborted_slots, dtype=np.int64)
        self._ended, self._aborted_slots = [], []
        self._make_room()
        adm = self._admit() if self.paused or (self.waiting and not self.table.busy_mask.all()) else None
        slots = self._running()
        live, settled = self._live(slots)
        it = self._iteration(live) if len(live) else None
        prefill = self._prefill_work(0 if it is None else len(live) * it.width)
        done = _NONE if prefill is None else prefill.done
        if it is None and len(done):
            # An idle engine: the rows this prefill completes take their first cycle in this same
            # step, the prefill's forward running first on its own (a batch that arrives at once
            # would otherwise spend a step on its first tokens alone).
            live, settle = self._live(done)
            it = self._iteration(live) if len(live) else None
            prefill = replace(prefill, ahead=True)
            settled = np.concatenate([settled, settle])
        else:
            settled = np.concatenate([settled, done])
        read = np.concatenate([slots, done]) if len(done) else slots
        # rows that hold a slot and sit the step out: preempted, or still prefilling
        out = np.union1d(self.paused.slots(), self.prefilling.slots()) if len(self.prefilling) else self.paused.slots()
        return ScheduledStep(kill, adm, it, settled, self.table.logprobs.width(read), self.pool.take_entries(),
                             out, prefill)

    def _live(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``slots`` split into the rows an iteration runs and those that sit it out and only have
        their result packed: no tokens left, or a constrained row before the host has its first token
        (its masks need it), or one whose grammar failed at admission (it ends at the update)."""
        settle = (self.table.remaining(slots) <= 0) | self.grammars.awaiting_first(slots, self.table.count)
        if self.grammars.failed:
            settle |= np.isin(slots, list(self.grammars.failed))
        return slots[~settle], slots[settle]

    def _prefill_work(self, running_tokens: int) -> PrefillWork | None:
        """Chunks of prefilling rows in what the running rows leave of the token budget; the rows
        they complete leave the queue, new ones become prefix holders and get their first token."""
        if not len(self.prefilling):
            return None
        taken = self.prefilling.take(self.budget - running_tokens)
        for seat in taken.complete:
            self.planner.register(seat)
            if self.pending is not None:
                self.pending.remove(seat.slot)
        done = np.sort(np.asarray([s.slot for s in taken.complete if s.new], dtype=np.int64))   # slots ascending
        if not taken.chunks and not len(done):
            return None
        masks = self.grammars.first[done] if self.grammars.any(done) else None
        return PrefillWork(attention_groups(taken.chunks, self.capacity), done, self.table.prompt_len[done], masks,
                           self.table.prefill_paths(done), self.table.logprobs.width(done), tuple(taken.copies))

    def _running(self) -> np.ndarray:
        """Occupied slots that are neither paused (preempted) nor prefilling, ascending."""
        return np.flatnonzero(self.table.busy_mask & ~self.paused.mask & ~self.prefilling.mask)

    def _iteration(self, live: np.ndarray) -> Iteration:
        """One cycle or AR step over the ``live`` rows."""
        remaining = int(self.table.remaining(live).max())      # the most tokens any of them may still take
        paths, constrained = self.table.paths(live), self.grammars.any(live)
        choice = self.speculation.choose(len(live), remaining, paths, constrained)
        return Iteration(choice.block, live, self.table.kv_len(live), paths,
                         first_masks=self.grammars.first[live] if constrained else None,
                         grammar=self.grammars if constrained else None, arm=choice.arm,
                         verify_eighths=choice.verify_eighths)

    def _make_room(self) -> None:
        """Every running row gets pages for its committed length plus one block (what this step may
        write; a prefilling row holds its tokens' and a block's from its seat). When the pool cannot
        give them, the newest rows are preempted, running or prefilling: they give their pages back
        and keep their slot and device state (sampling position, stop state), to be re-seated
        (their K/V recomputed) when pages free up. The need is array code over the running rows;
        Python runs only over rows that cross a page boundary or are preempted (events)."""
        slots = self._running()
        want = self.pool.pages_for(self.table.committed(slots) + self.block_size)
        need = np.maximum(want - self.pool.owned[slots], 0)
        if int(need.sum()) > self.pool.available() and len(slots) + len(self.prefilling) > 1:
            kept = self._preempt_newest(slots, need)
            slots, want, need = slots[kept], want[kept], need[kept]
        grow = np.flatnonzero(need)
        for slot, total in zip(slots[grow].tolist(), want[grow].tolist()):  # SYNC: none (host numpy)
            self.pool.grow(slot, total)

    def _preempt_newest(self, slots: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Preempt the newest rows (running ``slots`` with their ``need`` of pages, or prefilling)
        until the running rows' need fits the pool → a mask of the running rows kept. The oldest row
        always stays, and fits: the pool holds one row at full length (checked by the engine)."""
        rows = np.concatenate([slots, self.prefilling.slots()])
        needs = np.concatenate([need, np.zeros(len(rows) - len(slots), dtype=need.dtype)])
        kept = np.ones(len(rows), dtype=bool)
        total = int(need.sum())
        for i in np.argsort(self.order[rows])[:0:-1].tolist():   # newest first, all but the oldest
            if total <= self.pool.available():
                break
            if self.paused.mask[rows[i]]:        # already requeued with the row it followed
                kept[i] = False
                continue
            kept[i] = False
            total -= int(needs[i])
            self._preempt(int(rows[i]))
        return kept[: len(slots)]

    def _preempt(self, slot: int) -> None:
        """Take ``slot``'s pages back; it waits (first in line) to have its K/V recomputed."""
        first = next(iter(self.paused.seats), None)
        assert first is None or self.order[slot] < self.order[first], "a paused row is older than a running one"
        self._requeue_followers(slot)
        seat = self.prefilling.remove(slot)
        if seat is None:                         # a running row: its prompt and committed tokens
            n = int(self.table.committed(np.asarray([slot]))[0])
            req = self.table.requests[slot]
            tokens = np.concatenate([req.prompt_ids, self.table.generated(slot)[: n - len(req.prompt)]])
            hashes = block_hashes(tokens, self.pool.page_size) if self.page_index is not None else []
            seat = Seat(slot, tokens, hashes, new=False)
        self.paused.push(seat)
        self.pool.release(slot)
        for index in (self.prefix_index, self.pending):
            if index is not None:
                index.remove(slot)
        self.stats += EngineStats(preemptions=1)

    def _requeue_followers(self, slot: int) -> None:
        """``slot`` leaves while rows wait for its prompt's K/V (they share its pages, not yet
        filled): they give their pages back and are seated again first, from scratch. Bounded by rows."""
        for follower in self.prefilling.followers(slot):
            self._requeue_followers(follower)
            self.paused.push(self.prefilling.remove(follower))
            self.pool.release(follower)
            if self.pending is not None:
                self.pending.remove(follower)
            self.stats += EngineStats(preemptions=1)

    def _restart_followers(self, slot: int) -> None:
        """``slot`` ended (aborted, a failed grammar) before its prompt's K/V was complete: the rows
        that shared its pages compute their whole prompts in pages of their own instead (the pages
        they give back cover what they take: those of ``slot`` are back already). Bounded by rows."""
        for follower in self.prefilling.followers(slot):
            pages = len(self.pool.slot_pages[follower])
            self.pool.release(follower)
            self.pool.grow(follower, pages)
            self.stats += EngineStats(prefill_tokens=self.prefilling.restart(follower))
            self._restart_followers(follower)

    def _admit(self) -> Admission | None:
        """Re-seat preempted rows (oldest first), then seat waiting requests in free slots (FIFO),
        as far as the page pool allows, sharing every prompt prefix a page or a running slot holds
        (the prefix cache) instead of computing it; the seated rows join the prefilling queue."""
        free = self.table.free_slots()
        waiting = [self.waiting[i] for i in range(min(len(self.waiting), len(free)))]
        for r in waiting:
            if r.prefix_hashes is None:
                r.prefix_hashes = block_hashes(r.prompt_ids, self.pool.page_size) if self.page_index is not None else []
        paused = list(self.paused.seats.values())
        seats = paused + [Seat(int(s), r.prompt_ids, r.prefix_hashes, True)
                          for s, r in zip(free.tolist(), waiting)]  # SYNC: none (host numpy)
        plan = self.planner.plan(seats, self.pending)
        if not plan.seated:
            return None
        for seat, how in zip(seats, plan.seated):
            self.prefilling.add(seat, how)
        resumed = [s.slot for s in paused[: len(plan.seated)]]
        for slot in resumed:
            self.paused.pop(slot)
        reqs = [self.waiting.popleft() for _ in range(len(plan.seated) - len(resumed))]
        slots = free[: len(reqs)]
        now = time.perf_counter()
        for slot, r in zip(slots.tolist(), reqs):  # SYNC: none (host numpy)
            r.admitted = now
            self._admissions += 1
            self.order[slot] = self._admissions
        params = slot_params(reqs)
        self.table.admit(slots, reqs, params)
        self.grammars.admit(slots, [r.params.structured for r in reqs], [r.reasoning is not None for r in reqs])
        held = sum(len(r.prompt) for r in reqs) - plan.computed
        self.stats += EngineStats(admitting_steps=1, prefill_tokens=plan.computed, prefix_cache_hit_tokens=held,
                                  recomputed_tokens=plan.recomputed)
        return Admission(slots, np.asarray([len(r.prompt) for r in reqs], dtype=np.int64), params, plan.copies,
                         np.asarray(resumed, dtype=np.int64), *seen_prompts(slots, [r.prompt_ids for r in reqs], params))

    def update(self, step: ScheduledStep, out: StepOutput) -> list[RequestOutput]:
        """Fold a step's read into the host book → the requests that finished (rows the host ends
        here, by a stop string or a failed grammar, are marked dead by the next step)."""
        done, self._done = self._done, []
        it, rows = step.iteration, step.rows
        rec = None if out.packed is None else self.table.record(rows, out.packed, it.block if it is not None else AR)
        self.stats += self._step_stats(step, out, rec)     # one record per step: the counters add up
        if rec is None:
            return done
        if self.grammars.any(rows):
            self.grammars.advance(rows, self.table.generated)
        if it is not None and (it.arm is not None or it.verify_eighths is not None):
            # a step whose forward also computed prompt chunks times more than the arm: acceptance only
            # (and a step that compiled its plan times the compiler)
            chunked = step.prefill is not None and bool(step.prefill.groups)
            seconds = None if chunked or out.compile_ms else time.perf_counter() - out.started
            self.speculation.observe(it, seconds, rec)
        ended = dict(zip(rec.finished.tolist(), rec.reasons.tolist()))  # SYNC: none (host numpy)
        hits = self._scan_stops(rows)
        failed = self.grammars.take_failed()      # rows whose own grammar failed: they end in error
        for s in failed:
            hits.pop(s, None)
        self._ended += [s for s in (*hits, *failed) if s not in ended]
        return done + [self._output(s, FinishReason.ERROR, None, failed[s]) if s in failed else
                       self._output(s, FinishReason(ended.get(s, FinishReason.STOP)), hits.get(s))
                       for s in sorted(set(ended) | set(hits) | set(failed))]

    def _step_stats(self, step: ScheduledStep, out: StepOutput, rec: Recorded | None) -> EngineStats:
        """What one step adds to the engine's counters (a slot whose prompt chunk rode in the
        iteration's forward worked in it too; ``rec``: what its read recorded)."""
        it, slots = step.iteration, out.prefill_slots + out.iteration_slots
        if it is None:
            return EngineStats(forward_token_slots=slots, prefill_token_slots=out.prefill_slots,
                               read_steps=int(out.packed is not None), compile_ms=out.compile_ms)
        worked = len(it.slots)
        if step.prefill is not None and step.prefill.groups:
            worked = len(set(it.slots.tolist()) | {c.slot for g in step.prefill.groups for c in g})
        return EngineStats(iterations=1, busy_slot_iterations=worked, page_iterations=self.pool.in_use,
                           forward_token_slots=slots, prefill_token_slots=out.prefill_slots, read_steps=1,
                           verified_draft_tokens=rec.verified, accepted_draft_tokens=rec.tokens - rec.live,
                           compile_ms=out.compile_ms)

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
        self.prefilling.remove(slot)
        self._restart_followers(slot)
        for index in (self.prefix_index, self.pending):
            if index is not None:
                index.remove(slot)
        if hit is not None:
            return req.output(tokens, FinishReason.STOP, hit.stop, rel.stats, hit.text, lp)
        stop_reason = tokens[-1] if reason == FinishReason.STOP and tokens else None
        text = self.stops.completion(tokens, stop_reason is not None) if self.stops is not None else None
        return req.output(tokens, reason, stop_reason, rel.stats, text, lp, error=error)

