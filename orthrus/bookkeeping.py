"""Host side of decoding: which prompt sits in which slot, output tokens and statistics (numpy).

Updated once per cycle from the packed device result with vectorised numpy; Python loops run only
over rows that are admitted or finished (events), never over all rows every cycle.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from orthrus.decode import LENGTH, RUNNING, STOP
from orthrus.params import GenerationResult, RowStats

REASONS = {STOP: "stop", LENGTH: "length"}


class SlotBook:
    """Slots ↔ rows, per-slot output buffers and counters for one ``generate`` call."""

    def __init__(self, num_slots: int, num_rows: int, width: int, capacity: int) -> None:
        self.width = width
        self.pending: deque[int] = deque(range(num_rows))
        self.row = np.full(num_slots, -1, dtype=np.int64)          # -1 = free slot
        self.tokens = np.zeros((num_slots, capacity + width + 1), dtype=np.int64)
        self.count = np.zeros(num_slots, dtype=np.int64)           # generated tokens so far
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)
        self.cycles = np.zeros(num_slots, dtype=np.int64)
        self.accepted = np.zeros(num_slots, dtype=np.int64)
        self.drafted = np.zeros(num_slots, dtype=np.int64)
        self.ar_steps = np.zeros(num_slots, dtype=np.int64)
        self.hist = np.zeros((num_slots, width), dtype=np.int64)

    def busy(self) -> bool:
        """Rows are waiting or still decoding."""
        return bool(self.pending) or bool((self.row >= 0).any())

    def admit(self, prompt_lens: list[int]) -> tuple[np.ndarray, list[int]]:
        """Assign pending rows to free slots → (slots, rows)."""
        free = np.flatnonzero(self.row < 0)[: len(self.pending)]
        rows = [self.pending.popleft() for _ in range(len(free))]
        self.row[free] = rows
        self.count[free] = 0
        self.cycles[free] = 0
        self.accepted[free] = 0
        self.drafted[free] = 0
        self.ar_steps[free] = 0
        self.hist[free] = 0
        self.prompt_len[free] = [prompt_lens[r] for r in rows]
        return free, rows

    def occupied(self) -> np.ndarray:
        """Slots holding a row, ascending."""
        return np.flatnonzero(self.row >= 0)

    def kv_len(self, slots: np.ndarray) -> int:
        """Host-known bound on keys a block at these slots can see (no device read needed)."""
        committed = self.prompt_len[slots] + np.maximum(self.count[slots] - 1, 0)
        return int(committed.max()) + self.width

    def record(self, slots: np.ndarray, packed: np.ndarray, block_size: int
               ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Fold one iteration's packed result in (``block_size`` 0 = an AR step) → (finished slots,
        their reasons, sum of L+1 over live rows, number of live rows)."""
        w = packed.shape[1] - 5
        emitted, n_emit, n_acc, reason, alive, first = (packed[:, :w], packed[:, w], packed[:, w + 1],
                                                       packed[:, w + 2], packed[:, w + 3], packed[:, w + 4])
        new = first >= 0
        self.tokens[slots[new], 0] = first[new]
        self.count[slots[new]] = 1
        cols = self.count[slots][:, None] + np.arange(w)[None, :]
        keep = np.arange(w)[None, :] < n_emit[:, None]
        self.tokens[np.broadcast_to(slots[:, None], cols.shape)[keep], cols[keep]] = emitted[keep]
        self.count[slots] += n_emit
        live = alive.astype(bool)
        if not block_size:
            self.ar_steps[slots] += alive
            return slots[reason != RUNNING], reason[reason != RUNNING], int(live.sum()), int(live.sum())
        self.cycles[slots] += alive
        self.drafted[slots] += alive * (block_size - 1)
        self.accepted[slots] += n_acc
        np.add.at(self.hist, (slots[live], n_acc[live]), 1)
        tokens = int(n_acc[live].sum() + live.sum())
        return slots[reason != RUNNING], reason[reason != RUNNING], tokens, int(live.sum())

    def harvest(self, slot: int, reason: int, seed: int) -> tuple[int, GenerationResult]:
        """Free a finished slot → (row, result)."""
        row, c, a = int(self.row[slot]), int(self.cycles[slot]), int(self.ar_steps[slot])
        hist = self.hist[slot].tolist()  # SYNC: none — host numpy, once per finished row
        tokens = self.tokens[slot, : self.count[slot]].tolist()  # SYNC: none — host numpy, once per finished row
        stats = RowStats(num_cycles=c, num_forward_passes=1 + 2 * c + a, num_draft_tokens=int(self.drafted[slot]),
                         num_accepted_draft_tokens=int(self.accepted[slot]), accept_length_histogram=hist,
                         num_ar_steps=a)
        result = GenerationResult(tokens, REASONS[reason], seed, stats)
        self.row[slot] = -1
        return row, result
