"""Rows whose K/V is still being computed, and how each step's token budget is spent on them.

A seated row (a new request, or a preempted row seated again) computes its tokens from the first
position nothing shares or copies for it, in chunks: each step's one AR forward carries the
running rows' blocks first, then chunks of these rows, oldest seat first, up to the step's token
budget (``OrthrusEngine(max_num_batched_tokens=...)``, vLLM's scheduling). A long prompt is so
prefilled over several steps while the other rows keep decoding, and no row waits behind a
separate prefill forward. The oldest row always gets at least a floor of tokens, so that running
rows that fill the budget cannot starve it. Host only (numpy); per-row Python runs over the
prefilling rows (bounded by the slots), and only while some row is prefilling.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from orthrus.engine.host.admission import Seat, Seated
from orthrus.engine.step import PromptChunk, PromptCopy

CHUNK_FLOOR = 16   # tokens the oldest prefilling row gets in a step whatever the running rows take


@dataclass
class _Row:
    seat: Seat
    done: int                        # positions computed (or shared, copied) so far
    after: int = -1                  # a row whose prompt it shares: it waits for that row's K/V
    late: PromptCopy | None = None   # copied from that row when it completes
    holder: int = -1                 # that row, kept after the wait (its chunk's group comes first)


@dataclass(frozen=True)
class Taken:
    """One step's share of the prefilling rows: ``chunks`` to compute, the seats whose tokens are
    all computed after them (they left the queue), and the ``copies`` some of those take once the
    rows they share are complete."""

    chunks: list[PromptChunk]
    complete: list[Seat]
    copies: list[PromptCopy]


class Prefilling:
    """Seated rows still computing their tokens, in seat order, and a mask of their slots."""

    def __init__(self, num_slots: int) -> None:
        self.rows: OrderedDict[int, _Row] = OrderedDict()
        self.mask = np.zeros(num_slots, dtype=bool)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, seat: Seat, how: Seated) -> None:
        """``seat`` was seated as ``how`` says (its positions before ``how.start`` shared or copied)."""
        self.rows[seat.slot] = _Row(seat, how.start, how.after, how.late, how.after)
        self.mask[seat.slot] = True

    def followers(self, slot: int) -> list[int]:
        """Rows waiting for ``slot``'s K/V (they share pages it has not filled yet)."""
        return [s for s, row in self.rows.items() if row.after == slot]

    def remove(self, slot: int) -> Seat | None:
        """``slot`` leaves (preempted, aborted) → what seats it again (its tokens from the start), or None."""
        row = self.rows.pop(slot, None)
        if row is None:
            return None
        self.mask[slot] = False
        return row.seat

    def restart(self, slot: int) -> int:
        """``slot`` computes its tokens from position 0, on its own (what it shared is gone) → the
        positions it shared before, now computed too."""
        row = self.rows[slot]
        shared, row.done, row.after, row.holder, row.late = row.done, 0, -1, -1, None
        return shared

    def slots(self) -> np.ndarray:
        """The prefilling slots, ascending."""
        return np.flatnonzero(self.mask)

    def take(self, budget: int) -> Taken:
        """This step's chunks, oldest seat first, ``budget`` tokens in all (at least ``CHUNK_FLOOR``,
        or whatever the oldest row has left). A row that shares a prefilling row's prefix gets
        tokens only once that row is complete (in this step's forward or before: its chunk then
        comes later in the forward); one with nothing left to compute (an identical prompt)
        completes in the same step as that row, taking its copies. Bounded by the rows."""
        budget = max(budget, CHUNK_FLOOR)
        taken = Taken([], [], [])
        for slot, row in list(self.rows.items()):      # bounded by the rows
            if slot not in self.rows or row.after >= 0:   # completed with its row, or waiting for it
                # (a row it waits for leaves only by completing, which frees it, or by ending or
                # preemption, which restarts or requeues it: a wait on nothing would never end)
                assert slot not in self.rows or row.after in self.rows, "a row waits for one that left"
                continue
            left = len(row.seat.tokens) - row.done
            n = min(left, budget)
            if left > 0 and n == 0:
                break
            if n > 0:
                end = row.done + n
                taken.chunks.append(PromptChunk(slot, row.done, row.seat.tokens[row.done: end],
                                                last=end == len(row.seat.tokens) and row.seat.new, after=row.holder))
                row.done, budget = end, budget - n
            if row.done == len(row.seat.tokens):
                self._complete(slot, taken)
        return taken

    def _complete(self, slot: int, taken: Taken) -> None:
        """``slot``'s tokens are all computed after this step's forward: it leaves the queue, and so
        do the rows with the same prompt that wait for it (their copies after the forward); rows that
        share only its prefix compute their rest from now on. Bounded by the rows."""
        row = self.rows[slot]
        if row.late is not None:
            taken.copies.append(row.late)
        taken.complete.append(self.remove(slot))
        for follower in self.followers(slot):
            f = self.rows[follower]
            f.after = -1
            if f.done == len(f.seat.tokens):
                self._complete(follower, taken)

    def clear(self) -> None:
        """No row is prefilling."""
        self.rows.clear()
        self.mask[:] = False
