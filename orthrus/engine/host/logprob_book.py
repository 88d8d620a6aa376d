"""Per-token log-probabilities on the host: which width an iteration computes, and each slot's book.

Values are the log-softmax of the AR (target) view's raw logits (``device/logprobs.py`` gathers
them; they travel in the iteration's one read, ``packed.py``). Widths are bucketed (``WIDTHS``) so
that static-shape iterations capture few graphs; each row keeps its own k.
"""
from __future__ import annotations

import numpy as np

from orthrus.engine.host.requests import Request
from orthrus.engine.outputs import TokenLogprobs
from orthrus.engine.packed import LogprobBlock
from orthrus.params import MAX_LOGPROBS

WIDTHS = (0, 1, 2, 5, 10, MAX_LOGPROBS)   # top-k widths an iteration computes (each row keeps its own k)


def bucket(k: int, vocab_size: int) -> int:
    """The width an iteration computes for a largest request of ``k``: the next bucket, within the vocabulary."""
    return min(next(w for w in WIDTHS if w >= k), vocab_size)


class LogprobBook:
    """Per-slot logprobs on the host: each slot's requested k (-1 = off), token logprobs
    ``[B, capacity]`` written vectorised like the slot table's tokens, and top-k chunks per slot
    (appended only for rows that asked for k > 0)."""

    def __init__(self, num_slots: int, capacity: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.k = np.full(num_slots, -1, dtype=np.int64)
        self.token = np.zeros((num_slots, capacity), dtype=np.float64)
        self.top: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_slots)]

    def admit(self, slots: np.ndarray, requests: list[Request]) -> None:
        """Fresh books for ``requests`` seated in ``slots``."""
        self.k[slots] = [-1 if r.params.logprobs is None else r.params.logprobs for r in requests]
        for slot in slots.tolist():  # SYNC: none (host numpy)
            self.top[slot] = []

    def width(self, slots: np.ndarray) -> int | None:
        """The top-k width an iteration over ``slots`` computes; None when no row asked (no logprobs)."""
        k = int(self.k[slots].max()) if len(slots) else -1
        return None if k < 0 else bucket(k, self.vocab_size)

    def record(self, slots: np.ndarray, new: np.ndarray, count: np.ndarray, n_emit: np.ndarray,
               lp: LogprobBlock) -> None:
        """Fold in one iteration: a row admitted in it (``new``) keeps positions 0 … n_emit (its first
        token, then what it emitted), any other row positions 1 … n_emit after its ``count`` tokens."""
        start = np.where(new, 0, 1)                                           # [b]
        stop = 1 + n_emit                                                     # [b]
        wants = self.k[slots]
        j = np.arange(lp.token.shape[1])[None, :]                             # [1, 1+W]
        keep = (j >= start[:, None]) & (j < stop[:, None]) & (wants >= 0)[:, None]
        cols = np.where(new, 0, count)[:, None] + j - start[:, None]
        self.token[np.broadcast_to(slots[:, None], cols.shape)[keep], cols[keep]] = lp.token[keep]
        for i in np.flatnonzero(wants > 0).tolist():  # SYNC: none (host numpy); rows that asked for top-k
            k, a, b = wants[i], start[i], stop[i]
            if b > a:
                self.top[slots[i]].append((lp.top_id[i, a:b, :k].copy(), lp.top_lp[i, a:b, :k].copy()))

    def release(self, slot: int, keep: int) -> TokenLogprobs | None:
        """The first ``keep`` positions of ``slot``'s logprobs (None when its request asked for none)."""
        k = int(self.k[slot])
        if k < 0:
            return None
        top = None
        if k > 0:
            chunks = self.top[slot]
            ids = np.concatenate([c[0] for c in chunks])[:keep] if chunks else np.empty((0, k), np.int64)
            lps = np.concatenate([c[1] for c in chunks])[:keep] if chunks else np.empty((0, k))
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), lps.tolist())]  # SYNC: none (host numpy)
            self.top[slot] = []
        return TokenLogprobs(self.token[slot, :keep].tolist(), top)  # SYNC: none (host numpy)
