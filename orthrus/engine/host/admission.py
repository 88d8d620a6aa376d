"""Admission, host side: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots, as far as the KV page pool allows (``pages.py``); rows preempted for want of
pages are seated again first, their prompt and committed tokens recomputed. A prompt prefix is
computed at most once while some page or slot holds it (the prefix cache, ``prefix_cache.py``): a
request whose prompt starts with cached pages or like a running slot's prompt takes those pages by
reference (copying at most one partial page) and computes only the rest (nothing at all for an
identical running prompt: the n samples of one row); a request sharing a prefix with a row whose
prompt is still being computed waits for it, then shares it. The seated rows' K/V is then computed
in chunks within each step's token budget (``prefilling.py``). Every request keeps its own seed and
random stream, so its first token is still its own sample. The result is an
:class:`~orthrus.engine.step.Admission`: plain arrays that the runner moves to the device in one copy.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from orthrus.engine.host.pages import PagePool
from orthrus.engine.host.prefix_cache import PageIndex, PrefixIndex
from orthrus.engine.host.requests import Request
from orthrus.engine.step import PromptChunk, PromptCopy


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
class Seated:
    """How a seated row gets its K/V: computed from position ``start`` (the positions before it are
    shared or copied); ``after``: a row still prefilling whose prompt it shares (-1: none), whose
    pages it shares by reference and after whose K/V its own is computed; ``late``: what is copied
    from that row once its prompt is complete (an identical prompt: the partial page, the hidden
    state), None: nothing."""

    start: int
    after: int = -1
    late: PromptCopy | None = None


@dataclass(frozen=True)
class PromptPlan:
    """How the first ``len(seated)`` seats get their K/V (the rest wait: the pool is full): ``copies``
    from running slots, each seated row's :class:`Seated`, and the tokens that leaves to compute
    for new rows and for resumed ones."""

    copies: tuple[PromptCopy, ...]
    seated: tuple[Seated, ...]
    computed: int
    recomputed: int


@dataclass(frozen=True)
class _Source:
    """Where a row's first ``length`` positions come from: ``shared`` whole pages by reference and,
    from a running ``holder`` slot, its ``partial`` page copied (-1: none) and with ``whole`` its
    hidden state; ``after``: the holder is still prefilling (the copies wait for it)."""

    shared: list[int]
    length: int
    holder: int = -1
    partial: int = -1
    whole: bool = False
    after: bool = False


class PromptPlanner:
    """Pages and prompt sources for rows being seated (``pages``/``holders`` None: no prefix cache)."""

    def __init__(self, pool: PagePool, pages: PageIndex | None, holders: PrefixIndex | None, capacity: int,
                 block: int) -> None:
        self.pool, self.pages, self.holders, self.capacity, self.block = pool, pages, holders, capacity, block

    def plan(self, seats: list[Seat], pending: PrefixIndex | None) -> PromptPlan:
        """Take pages for as many ``seats`` as the pool allows, in order; share every prefix some
        page, running slot or prefilling row (``pending``; this step's new seats join it) holds.
        Bounded by the seats."""
        copies: list[PromptCopy] = []
        seated: list[Seated] = []
        computed = recomputed = 0
        for seat in seats:
            src = self._source(seat, pending)
            need = int(self.pool.pages_for(len(seat.tokens) + self.block))
            if need - len(src.shared) > self.pool.available() - sum(p in self.pool.cached for p in src.shared):
                break
            self.pool.share(seat.slot, src.shared)
            self.pool.grow(seat.slot, need)
            copy = None
            if src.partial >= 0 or src.whole:
                page = self.pool.slot_pages[seat.slot][len(src.shared)] if src.partial >= 0 else -1
                copy = PromptCopy(src.holder, seat.slot, src.partial, page, src.whole)
            if copy is not None and not src.after:
                copies.append(copy)
            seated.append(Seated(src.length, src.holder if src.after else -1, copy if src.after else None))
            computed += (len(seat.tokens) - src.length) * seat.new
            recomputed += (len(seat.tokens) - src.length) * (not seat.new)
            if seat.new and pending is not None:
                pending.add(seat.slot, seat.tokens, seat.hashes)
        return PromptPlan(tuple(copies), tuple(seated), computed, recomputed)

    def _source(self, seat: Seat, pending: PrefixIndex | None) -> _Source:
        """The longest prefix of ``seat`` held by cached pages, a running slot, or (for a new row) a
        row still prefilling. The last token is computed unless a new row's whole prompt is held
        (its hidden state is then copied too): a row never writes a page it shares."""
        n = len(seat.tokens)
        best = _Source([], 0)
        if self.pages is None:
            return best
        shared = self.pages.match(seat.tokens, seat.hashes, (n - 1) // self.pool.page_size)
        best = _Source(shared, len(shared) * self.pool.page_size)
        m = self.holders.match(seat.tokens, seat.hashes)
        whole = m is not None and m.whole and seat.new
        length = 0 if m is None else (n if whole else min(m.length, n - 1))
        if length > best.length or (whole and not best.whole):
            held = self.pool.slot_pages[m.slot]
            full = length // self.pool.page_size
            partial = held[full] if length % self.pool.page_size else -1
            best = _Source(held[:full], length, m.slot, partial, whole)
        later = pending.match(seat.tokens, seat.hashes) if pending is not None and seat.new else None
        return best if later is None else self._later(seat, later, best)

    def _later(self, seat: Seat, m, best: _Source) -> _Source:
        """``best``, or a prefilling row's prefix when that is longer: its whole pages by reference
        (their K/V is computed before this row's, in the same forward or earlier); an identical
        prompt also copies the partial page and the hidden state once that row completes, a longer
        one computes from the last whole page (a page cannot be copied before it is filled)."""
        n, page = len(seat.tokens), self.pool.page_size
        held = self.pool.slot_pages[m.slot]
        if m.whole and n > best.length:
            return _Source(held[: n // page], n, m.slot, held[n // page] if n % page else -1, True, True)
        full = min(m.length, n - 1) // page
        if full * page > best.length:
            return _Source(held[:full], full * page, m.slot, after=True)
        return best

    def register(self, seat: Seat) -> None:
        """``seat``'s prompt K/V is complete (a new row): its slot and its whole prompt pages hold
        that prompt for later seats (the step that computed it runs before any later step's reads)."""
        if self.pages is None or not seat.new:
            return
        self.holders.add(seat.slot, seat.tokens, seat.hashes)
        self.pages.add(seat.tokens, seat.hashes, self.pool.slot_pages[seat.slot][: len(seat.tokens) // self.pool.page_size])


PAD_RATIO = 2   # a row joins an attention group only if the group's longest rest is at most this times its own


def attention_groups(chunks: list[PromptChunk], capacity: int) -> tuple[tuple[PromptChunk, ...], ...]:
    """A step's prompt chunks in attention groups (``model/ragged.py``), in queue order (a row that
    shares a prefilling row's prefix comes after it, and its group after that row's: each group
    writes its K/V before a later one reads it). A chunk joins the open group while neither it nor
    the group's longest is padded past ``PAD_RATIO`` times its length (attention over pads is the
    only padded work left), start + padded length <= ``capacity`` for every row (a pad token's K/V
    is written at its position), and the row it follows is not in the group. Bounded by chunks."""
    groups: list[list[PromptChunk]] = []
    for c in chunks:
        g = groups[-1] if groups else None
        if g is not None:
            t = max(len(c.rest), max(len(r.rest) for r in g))
            fits = t <= PAD_RATIO * min(len(c.rest), min(len(r.rest) for r in g))
            if fits and max(c.start, max(r.start for r in g)) + t <= capacity and c.after not in {r.slot for r in g}:
                g.append(c)
                continue
        groups.append([c])
    return tuple(tuple(g) for g in groups)
