"""Per-token log-probabilities: gathered on the device, carried by the iteration's one host read, kept on the host.

Values are the log-softmax of the AR (target) view's *raw* logits (before temperature, top-k and
top-p) at each generated position: what plain AR decoding of the same tokens reports, whatever the
drafts were. A speculative cycle's verify forward has the AR logits of every block position, so
accepted drafts and the corrected/bonus token all read theirs there; an AR step reads its one
position; a row's first token reads the prefill's logits, kept in ``SlotState`` until the row's
first iteration packs it (the prefill itself reads nothing back).

Cost: an iteration computes logprobs only when a row in it asked (``LogprobBook.width``, host-known
like the sampling fast paths); then its packed int64 result grows by a block (``block``) of float64
bit patterns and token ids, in the same single transfer. Widths are bucketed (``WIDTHS``) so that
static-shape iterations capture few graphs.

Layout of the block, per row: ``[(1 + W) positions × (logprob, top_lp (w), top_id (w))]`` where
position 0 is the prefill's first token (meaningful only for a row admitted in this step) and
positions 1 … W the emitted tokens; floats are float64 bits in the int64 tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from orthrus.params import MAX_LOGPROBS

if TYPE_CHECKING:
    from orthrus.engine.decode import SlotState
    from orthrus.engine.requests import Request

WIDTHS = (0, 1, 2, 5, 10, MAX_LOGPROBS)   # top-k widths an iteration computes (each row keeps its own k)


def bucket(k: int, vocab_size: int) -> int:
    """The width an iteration computes for a largest request of ``k``: the next bucket, within the vocabulary."""
    return min(next(w for w in WIDTHS if w >= k), vocab_size)


# ------------------------------------------------------------------------------------------- device


def gather(logits: torch.Tensor, tokens: torch.Tensor, width: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logits ``[b, T, V]`` and tokens ``[b, T]`` → token logprobs ``[b, T]``, top ``width``
    logprobs ``[b, T, w]`` (descending) and their ids ``[b, T, w]``; float32 at least (float64 for a
    float64 model)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lsm = logits.to(work).log_softmax(-1)                                     # [b, T, V]
    lp = lsm.gather(-1, tokens[..., None]).squeeze(-1)                        # [b, T]
    if width == 0:
        return lp, lsm[..., :0], tokens[..., None][..., :0]
    top_lp, top_id = lsm.topk(width, -1)                                      # [b, T, w]
    return lp, top_lp, top_id


def store_first(st: SlotState, slots: torch.Tensor, logits: torch.Tensor, first: torch.Tensor, width: int) -> None:
    """Keep the first tokens' logprobs (prefill logits ``[b, 1, V]``, tokens ``first [b]``) in the
    slots' state until their first iteration packs them."""
    lp, top_lp, top_id = gather(logits, first[:, None], width)
    st.first_lp[slots] = lp[:, 0].to(torch.float64)
    if width:
        st.first_top_lp[slots, :width] = top_lp[:, 0].to(torch.float64)
        st.first_top_id[slots, :width] = top_id[:, 0]


def block(st: SlotState, slots: torch.Tensor, logits: torch.Tensor, emitted: torch.Tensor,
          width: int) -> torch.Tensor:
    """One iteration's logprob block ``[b, (1 + W) * (1 + 2w)]`` int64: the stored first token,
    then the emitted tokens ``[b, W]`` scored by their AR logits ``[b, W, V]``."""
    return _assemble(st, slots, *gather(logits, emitted, width), width)


def first_block(st: SlotState, slots: torch.Tensor, positions: int, width: int) -> torch.Tensor:
    """The block of rows that emit nothing this iteration (complete after their prefill): the stored
    first token, then ``positions`` empty positions."""
    b = slots.shape[0]
    lp = torch.zeros((b, positions), dtype=torch.float64, device=slots.device)
    top_id = torch.zeros((b, positions, width), dtype=torch.long, device=slots.device)
    return _assemble(st, slots, lp, lp[..., None].expand(b, positions, width), top_id, width)


def _assemble(st: SlotState, slots: torch.Tensor, lp: torch.Tensor, top_lp: torch.Tensor, top_id: torch.Tensor,
              width: int) -> torch.Tensor:
    lp = torch.cat([st.first_lp[slots][:, None], lp.to(torch.float64)], 1)                       # [b, 1+W]
    top_lp = torch.cat([st.first_top_lp[slots][:, None, :width], top_lp.to(torch.float64)], 1)  # [b, 1+W, w]
    top_id = torch.cat([st.first_top_id[slots][:, None, :width], top_id], 1)                    # [b, 1+W, w]
    floats = torch.cat([lp[..., None], top_lp], -1).view(torch.int64)                           # [b, 1+W, 1+w]
    return torch.cat([floats, top_id], -1).flatten(1)


# --------------------------------------------------------------------------------------------- host


@dataclass(frozen=True)
class LogprobBlock:
    """Host side of one iteration's block (position 0 = the prefill's first token)."""

    token: np.ndarray     # [b, 1+W] float64
    top_lp: np.ndarray    # [b, 1+W, w] float64
    top_id: np.ndarray    # [b, 1+W, w] int64

    @classmethod
    def unpack(cls, host: np.ndarray, width: int) -> "LogprobBlock":
        """Split the ``[b, (1 + W) * (1 + 2w)]`` int64 tail of a packed result."""
        cells = host.reshape(host.shape[0], -1, 1 + 2 * width)                # [b, 1+W, 1+2w]
        floats = np.ascontiguousarray(cells[..., : 1 + width]).view(np.float64)
        return cls(floats[..., 0], floats[..., 1:], cells[..., 1 + width:])


def block_columns(positions: int, width: int) -> int:
    """Columns of a block over ``positions`` (1 + W) at top-k ``width``."""
    return positions * (1 + 2 * width)


@dataclass(frozen=True)
class TokenLogprobs:
    """One finished row's logprobs, aligned with its token ids."""

    token: list[float]
    top: list[list[tuple[int, float]]] | None      # None unless the row asked for k > 0

    @property
    def cumulative(self) -> float:
        """Sum of the token logprobs."""
        return float(sum(self.token))


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
