"""Host side of decoding: the slot table (which request sits in which slot), output tokens and
per-slot statistics, in numpy.

Updated once per iteration from the packed device result with vectorised numpy; Python loops run
only over requests that are admitted or finished (events) and over rows that have stop strings,
never over all rows every iteration. The book lives as long as the engine: slots are refilled as
requests finish.
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass, fields

from orthrus.engine.host.logprob_book import LogprobBook
from orthrus.engine.host.requests import Request
from orthrus.engine.outputs import FinishReason
from orthrus.engine.packed import Packed
from orthrus.engine.row_settings import HostSettings
from orthrus.engine.step import SamplingPaths, SlotParams
from orthrus.params import RowStats


@dataclass(frozen=True)
class Recorded:
    """What one iteration did, from the host's book: the slots that finished in it and their
    ``FinishReason`` codes, tokens produced by its live rows (sum of L + 1: the accepted drafts are
    ``tokens - live``), how many rows were live, and the drafts they verified."""

    finished: np.ndarray
    reasons: np.ndarray
    tokens: int
    live: int
    verified: int = 0


@dataclass(frozen=True)
class Released:
    """A freed slot's request, the tokens it keeps, and its statistics."""

    request: Request
    tokens: list[int]
    stats: RowStats


@dataclass
class RowCounters:
    """Per-slot counters of the row in it, ``[B]`` (``hist [B, width]``); all start at zero when a
    row is seated (:meth:`reset`, over ``fields()``: a counter added here cannot leak between rows).
    ``thinking_*``: the iterations and accepted drafts that began in the row's reasoning phase."""

    count: np.ndarray            # generated tokens so far
    cycles: np.ndarray
    accepted: np.ndarray
    drafted: np.ndarray
    verified: np.ndarray
    ar_steps: np.ndarray
    hist: np.ndarray
    thinking_cycles: np.ndarray
    thinking_ar_steps: np.ndarray
    thinking_accepted: np.ndarray

    @classmethod
    def zeros(cls, num_slots: int, width: int) -> RowCounters:
        """Every counter at zero (``hist`` one column per accept length)."""
        return cls(**{f.name: np.zeros((num_slots, width) if f.name == "hist" else num_slots, dtype=np.int64)
                      for f in fields(cls)})

    def reset(self, slots: np.ndarray) -> None:
        """Zero every counter of ``slots``."""
        for f in fields(self):
            getattr(self, f.name)[slots] = 0


class SlotTable:
    """Slots ↔ requests, per-slot output buffers ``[B, capacity]`` and counters; the rows'
    logprobs in ``logprobs`` (``vocab_size`` bounds their top-k width)."""

    def __init__(self, num_slots: int, width: int, capacity: int, vocab_size: int) -> None:
        self.width = width
        self.capacity = capacity
        self.requests: list[Request | None] = [None] * num_slots
        self.busy_mask = np.zeros(num_slots, dtype=bool)
        self.tokens = np.zeros((num_slots, capacity + width + 1), dtype=np.int64)
        self.counters = RowCounters.zeros(num_slots, width)
        self.count = self.counters.count                           # generated tokens so far
        self.settings = HostSettings(num_slots)                    # the rows' per-row settings
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)
        self.limit = np.zeros(num_slots, dtype=np.int64)           # most tokens the row may generate
        self.has_stops = np.zeros(num_slots, dtype=bool)           # has stop strings to scan for
        # Reasoning rows: still in their phase (before their think end).
        self.think_end = -1
        self.thinking = np.zeros(num_slots, dtype=bool)
        self.logprobs = LogprobBook(num_slots, self.tokens.shape[1], vocab_size)

    def free_slots(self) -> np.ndarray:
        """Empty slots, ascending."""
        return np.flatnonzero(~self.busy_mask)

    def occupied(self) -> np.ndarray:
        """Slots holding a request, ascending."""
        return np.flatnonzero(self.busy_mask)

    def paths(self, slots: np.ndarray) -> SamplingPaths:
        """The sampling fast paths an iteration over these rows may take (a row admitted this step
        counts its first token, sampled by its prefill, as in ``remaining``)."""
        return self._paths(slots, np.maximum(self.count[slots], 1))

    def prefill_paths(self, slots: np.ndarray) -> SamplingPaths:
        """The sampling fast paths of the prefill that samples these rows' first tokens."""
        return self._paths(slots, np.zeros(len(slots), dtype=np.int64))

    def _paths(self, slots: np.ndarray, produced: np.ndarray) -> SamplingPaths:
        s = self.settings
        early = s["min_new"][slots] > produced        # the next token may not be a stop (min_tokens)
        # A budget may still force tokens (conservative: the host does not look for an earlier think end).
        think_at = s["think_at"][slots]
        forcing = (think_at >= 0) & (think_at + s["think_span"][slots] - 1 >= produced)
        return SamplingPaths(all_greedy=bool(s["greedy"][slots].all()), min_tokens=bool(early.any()),
                             thinking=bool(forcing.any()), **s.paths(slots))

    def admit(self, slots: np.ndarray, requests: list[Request], params: SlotParams) -> None:
        """Seat ``requests`` (their settings ``params``) in ``slots`` with fresh counters."""
        for slot, req in zip(slots.tolist(), requests):  # SYNC: none (host numpy)
            self.requests[slot] = req
            req.slot = slot
        self.busy_mask[slots] = True
        self.counters.reset(slots)
        self.settings.admit(slots, params)
        self.thinking[slots] = [r.reasoning is not None for r in requests]
        self.think_end = next((r.reasoning.end for r in requests if r.reasoning is not None), self.think_end)
        self.prompt_len[slots] = [len(r.prompt) for r in requests]
        self.limit[slots] = np.minimum(params["max_new"], self.capacity - self.prompt_len[slots])
        self.has_stops[slots] = [bool(r.params.stop) for r in requests]
        self.logprobs.admit(slots, requests)

    def remaining(self, slots: np.ndarray) -> np.ndarray:
        """Tokens each row may still generate. A row admitted this step counts its first token,
        which its prefill sampled and the host has not read yet (every occupied row has one)."""
        return self.limit[slots] - np.maximum(self.count[slots], 1)

    def committed(self, slots: np.ndarray) -> np.ndarray:
        """Tokens each row has in the KV cache: its prompt and every generated token but the last
        (the anchor the next iteration writes first); a row admitted this step has its prompt."""
        return self.prompt_len[slots] + np.maximum(self.count[slots] - 1, 0)

    def kv_len(self, slots: np.ndarray) -> int:
        """Host-known bound on keys a block at these slots can see (no device read needed)."""
        return int(self.committed(slots).max()) + self.width

    def record(self, slots: np.ndarray, out: Packed, block_size: int) -> Recorded:
        """Fold one iteration in (``block_size`` 0 = an AR step) → what it did."""
        new = out.first >= 0
        if out.logprobs is not None:
            self.logprobs.record(slots, new, self.count[slots], out.n_emit, out.logprobs)
        self.tokens[slots[new], 0] = out.first[new]
        self.count[slots[new]] = 1
        w = out.emitted.shape[1]
        cols = self.count[slots][:, None] + np.arange(w)[None, :]
        keep = np.arange(w)[None, :] < out.n_emit[:, None]
        self.tokens[np.broadcast_to(slots[:, None], cols.shape)[keep], cols[keep]] = out.emitted[keep]
        self.count[slots] += out.n_emit
        live = out.alive
        ended = out.reason != FinishReason.RUNNING
        # began this iteration in its reasoning phase (a first token, sampled before it, may have ended it)
        thinking = live & self.thinking[slots] & (out.first != self.think_end)
        self.thinking[slots] &= ~(((out.emitted == self.think_end) & keep).any(1) | (out.first == self.think_end))
        c = self.counters
        if not block_size:
            c.ar_steps[slots] += live
            c.thinking_ar_steps[slots] += thinking
            return Recorded(slots[ended], out.reason[ended], int(live.sum()), int(live.sum()))
        c.cycles[slots] += live
        c.drafted[slots] += live * (block_size - 1)
        c.accepted[slots] += out.n_acc
        c.verified[slots] += out.n_ver
        c.thinking_cycles[slots] += thinking
        c.thinking_accepted[slots] += out.n_acc * thinking
        np.add.at(c.hist, (slots[live], out.n_acc[live]), 1)
        n_live = int(live.sum())
        return Recorded(slots[ended], out.reason[ended], int(out.n_acc[live].sum()) + n_live, n_live,
                        int(out.n_ver[live].sum()))

    def generated(self, slot: int) -> np.ndarray:
        """The slot's generated tokens so far (a view)."""
        return self.tokens[slot, : self.count[slot]]

    def release(self, slot: int, keep: int | None = None, end: int | None = None) -> Released:
        """Free ``slot`` → its request, its first ``keep`` tokens (all by default), its stats.

        ``end``: tokens up to the one that completed a stop string; those decoded after it are counted."""
        req = self.requests[slot]
        assert req is not None, f"slot {slot} is empty"
        count = int(self.count[slot])
        keep = count if keep is None else keep
        k = self.counters
        c, a = int(k.cycles[slot]), int(k.ar_steps[slot])
        stats = RowStats(num_cycles=c, num_forward_passes=1 + 2 * c + a, num_draft_tokens=int(k.drafted[slot]),
                         num_accepted_draft_tokens=int(k.accepted[slot]),
                         accept_length_histogram=k.hist[slot].tolist(), num_ar_steps=a,  # SYNC: none (host numpy)
                         num_tokens_after_stop=0 if end is None else count - end,
                         num_reasoning_cycles=int(k.thinking_cycles[slot]),
                         num_reasoning_ar_steps=int(k.thinking_ar_steps[slot]),
                         num_reasoning_accepted_draft_tokens=int(k.thinking_accepted[slot]),
                         num_verified_draft_tokens=int(k.verified[slot]))
        tokens = self.tokens[slot, :keep].tolist()  # SYNC: none (host numpy)
        self.requests[slot] = None
        self.busy_mask[slot] = False
        req.slot = -1
        return Released(req, tokens, stats)
