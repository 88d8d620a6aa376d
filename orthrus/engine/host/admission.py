"""Admission, host side: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots, as far as the KV page pool allows (``pages.py``); rows preempted for want of
pages are seated again first, their prompt and committed tokens recomputed. A prompt prefix is
computed at most once while some page or slot holds it (the prefix cache, ``prefix_cache.py``): a
request whose prompt starts with cached pages or like a running slot's prompt takes those pages by
reference (copying at most one partial page) and computes only the rest (nothing at all for an
identical running prompt: the n samples of one row); requests admitted in the same step that share
a prefix compute it once, in the first of the step's two prefill stages (``device/prefill.py``),
and the others share it. Every request keeps its own seed and random stream, so its first token is still
its own sample. The result is an :class:`~orthrus.engine.step.Admission`: plain arrays that the
runner moves to the device in one copy.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from orthrus.engine.host.pages import PagePool
from orthrus.engine.host.prefix_cache import PageIndex, PrefixIndex
from orthrus.engine.host.requests import Request
from orthrus.engine.step import PromptCopy, PromptRest, SlotParams, StagePlan


def admit(waiting: deque[Request], free: np.ndarray) -> list[Request]:
    """Pop as many waiting requests as there are free slots (FIFO); they take ``free`` in order."""
    return [waiting.popleft() for _ in range(min(len(waiting), len(free)))]


def slot_params(reqs: list[Request], eos_token_ids: tuple[int, ...]) -> SlotParams:
    """The requests' sampling parameters as ``[n]`` arrays; ``stop_ids [n, S]``: EOS and each one's
    own stop ids, padded with -1 (S: the most any of them has)."""
    ids = [sorted(set(eos_token_ids) | set(r.params.stop_token_ids)) for r in reqs]
    stops = np.full((len(reqs), max(map(len, ids), default=0)), -1, dtype=np.int64)
    for i, row in enumerate(ids):
        stops[i, : len(row)] = row
    ps = [r.params for r in reqs]
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return SlotParams(stop_ids=stops, seed=ints([r.seed for r in reqs]), max_new=ints([p.max_new_tokens for p in ps]),
                      min_new=ints([p.min_tokens for p in ps]), think_at=ints([r.think_at for r in reqs]),
                      think_span=ints([r.think_span for r in reqs]), top_k=ints([p.top_k for p in ps]),
                      temperature=np.asarray([p.temperature for p in ps], dtype=np.float64),
                      top_p=np.asarray([p.top_p for p in ps], dtype=np.float64),
                      greedy=np.asarray([p.greedy for p in ps], dtype=bool))


@dataclass(frozen=True)
class Seat:
    """A row to give pages and K/V in ``slot``: a new request's prompt (``new``: its first token is
    sampled after, and an identical running prompt's hidden state may stand in for its last
    position), or a preempted row's prompt and committed tokens (recomputed, nothing sampled)."""

    slot: int
    tokens: np.ndarray
    hashes: list[int]
    new: bool


class PausedRows:
    """Preempted rows waiting to be re-seated, in resume order (oldest admitted first), and a mask of
    their slots. Kept in that order without sorting: a row is preempted only while it is the newest
    running row, and no new request is seated while a row waits (re-seating comes first and
    :meth:`PromptPlanner.plan` stops at the first seat that does not fit), so every paused row is
    newer than every running one and a newly preempted row goes first in line."""

    def __init__(self, num_slots: int) -> None:
        self.seats: OrderedDict[int, Seat] = OrderedDict()     # slot -> what re-seats it
        self.mask = np.zeros(num_slots, dtype=bool)

    def __len__(self) -> int:
        return len(self.seats)

    def push(self, seat: Seat) -> None:
        """``seat``'s row was just preempted: first in line (see the class docstring)."""
        self.seats[seat.slot] = seat
        self.seats.move_to_end(seat.slot, last=False)
        self.mask[seat.slot] = True

    def pop(self, slot: int) -> None:
        """``slot`` is re-seated or its request ended. Not paused: no-op."""
        if self.seats.pop(slot, None) is not None:
            self.mask[slot] = False

    def slots(self) -> np.ndarray:
        """The paused slots, ascending."""
        return np.flatnonzero(self.mask)

    def clear(self) -> None:
        """No row waits."""
        self.seats.clear()
        self.mask[:] = False


@dataclass(frozen=True)
class PromptPlan:
    """How the first ``seated`` rows get their K/V (the rest wait: the pool is full): the two
    prefill stages, and the tokens they compute for new rows and for resumed ones."""

    stages: tuple[StagePlan, StagePlan]
    seated: int
    computed: int
    recomputed: int


@dataclass(frozen=True)
class _Source:
    """Where a row's first ``length`` positions come from, in ``stage``: ``shared`` whole pages by
    reference and, from a running ``holder`` slot, its ``partial`` page copied (-1: none) and with
    ``whole`` its hidden state."""

    stage: int
    shared: list[int]
    length: int
    holder: int = -1
    partial: int = -1
    whole: bool = False


class PromptPlanner:
    """Pages and prefill stages for rows being seated (``pages``/``holders`` None: no prefix cache)."""

    def __init__(self, pool: PagePool, pages: PageIndex | None, holders: PrefixIndex | None, capacity: int,
                 block: int) -> None:
        self.pool, self.pages, self.holders, self.capacity, self.block = pool, pages, holders, capacity, block

    def plan(self, seats: list[Seat]) -> PromptPlan:
        """Take pages for as many ``seats`` as the pool allows, in order; share every prefix some
        page or running slot holds. Bounded by the seats."""
        copies: tuple[list[PromptCopy], list[PromptCopy]] = ([], [])
        rests: tuple[list[PromptRest], list[PromptRest]] = ([], [])
        fresh = PrefixIndex(self.pool.page_size) if self.holders is not None else None   # rows stage 1 computes
        seated = computed = recomputed = 0
        for seat in seats:
            src = self._source(seat, fresh)
            need = int(self.pool.pages_for(len(seat.tokens) + self.block))
            if need - len(src.shared) > self.pool.available() - sum(p in self.pool.cached for p in src.shared):
                break
            self.pool.share(seat.slot, src.shared)
            self.pool.grow(seat.slot, need)
            if src.partial >= 0 or src.whole:
                page = self.pool.slot_pages[seat.slot][len(src.shared)] if src.partial >= 0 else -1
                copies[src.stage].append(PromptCopy(src.holder, seat.slot, src.partial, page, src.whole))
            if src.length < len(seat.tokens):
                rests[src.stage].append(PromptRest(seat.slot, src.length, seat.tokens[src.length:]))
                computed += (len(seat.tokens) - src.length) * seat.new
                recomputed += (len(seat.tokens) - src.length) * (not seat.new)
            if src.stage == 0 and seat.new and fresh is not None:
                fresh.add(seat.slot, seat.tokens, seat.hashes)
            seated += 1
        self._register(seats[:seated])
        stages = tuple(StagePlan(tuple(c), _attention_groups(r, self.capacity)) for c, r in zip(copies, rests))
        return PromptPlan(stages, seated, computed, recomputed)

    def _source(self, seat: Seat, fresh: PrefixIndex | None) -> _Source:
        """The longest prefix of ``seat`` held by cached pages, a running slot (stage 0) or a row this
        step computes first (stage 1). The last token is computed unless a new row's whole prompt is
        held (its hidden state is then copied too): a row never writes a page it shares."""
        n = len(seat.tokens)
        best = _Source(0, [], 0)
        if self.pages is None:
            return best
        shared = self.pages.match(seat.tokens, seat.hashes, (n - 1) // self.pool.page_size)
        best = _Source(0, shared, len(shared) * self.pool.page_size)
        for stage, index in ((0, self.holders), (1, fresh)):
            m = index.match(seat.tokens, seat.hashes)
            whole = m is not None and m.whole and seat.new
            length = 0 if m is None else (n if whole else min(m.length, n - 1))
            if length > best.length or (whole and not best.whole):
                held = self.pool.slot_pages[m.slot]
                full = length // self.pool.page_size
                partial = held[full] if length % self.pool.page_size else -1
                best = _Source(stage, held[:full], length, m.slot, partial, whole)
        return best

    def _register(self, seats: list[Seat]) -> None:
        """New rows run their prompts, and their whole prompt pages hold those prompts' K/V from this
        step on (findable by later steps only: this step's forwards fill them)."""
        if self.pages is None:
            return
        for seat in seats:
            if seat.new:
                self.holders.add(seat.slot, seat.tokens, seat.hashes)
                self.pages.add(seat.tokens, seat.hashes, self.pool.slot_pages[seat.slot][: len(seat.tokens) // self.pool.page_size])


PAD_RATIO = 2   # a row joins an attention group only if the group's longest rest is at most this times its own


def _attention_groups(rows: list[PromptRest], capacity: int) -> tuple[tuple[PromptRest, ...], ...]:
    """Rows of one stage's flat forward in attention groups (``model/ragged.py``), longest rest
    first: a row joins the open group while it would be padded to at most ``PAD_RATIO`` times its
    length (attention over pads is the only padded work left) and start + padded length <=
    ``capacity`` for every row (a pad token's K/V is written at its position). Bounded by rows."""
    groups: list[list[PromptRest]] = []
    for row in sorted(rows, key=lambda r: -len(r.rest)):
        g = groups[-1] if groups else None
        if (g is not None and len(g[0].rest) <= PAD_RATIO * len(row.rest)
                and max(row.start, max(r.start for r in g)) + len(g[0].rest) <= capacity):
            g.append(row)
        else:
            groups.append([row])
    return tuple(tuple(g) for g in groups)
