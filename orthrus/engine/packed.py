"""The one device→host transfer per iteration, described once (the device builds it from ``COLUMNS``
and ``logprob_columns``; the host splits it here). Numpy only.

Per row (int64): ``[emitted (W) | n_emit | n_acc | reason | alive_before | first | n_ver | logprobs?]``
where W is the iteration's block size (1 for an AR step), ``n_emit`` the tokens kept after stop
truncation, ``n_acc`` the accepted drafts L, ``reason`` a ``FinishReason`` code, ``alive_before``
whether the row decoded in this iteration, ``first`` the token sampled at prefill (-1 when the row
was not just admitted) and ``n_ver`` the drafts the row verified (its verify budget; 0 in an AR step). Only when some row of the iteration asked for logprobs, a logprob block follows:
per row ``(1 + W)`` positions × ``(logprob, top_lp (w), top_id (w))``, where position 0 is the
prefill's first token (meaningful only for a row admitted in this step) and positions 1 … W the
emitted tokens; floats travel as float64 bit patterns in the int64 tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMNS = ("n_emit", "n_acc", "reason", "alive", "first", "n_ver")   # after the emitted tokens, in this order
TRAILER = len(COLUMNS)


def logprob_columns(positions: int, width: int) -> int:
    """Columns of a logprob block over ``positions`` (1 + W) at top-k ``width``."""
    return positions * (1 + 2 * width)


@dataclass(frozen=True)
class LogprobBlock:
    """Host side of one iteration's logprob block (position 0 = the prefill's first token)."""

    token: np.ndarray     # [b, 1+W] float64
    top_lp: np.ndarray    # [b, 1+W, w] float64
    top_id: np.ndarray    # [b, 1+W, w] int64

    @classmethod
    def unpack(cls, host: np.ndarray, width: int) -> LogprobBlock:
        """Split the ``[b, (1 + W) * (1 + 2w)]`` int64 tail of a packed result."""
        cells = host.reshape(host.shape[0], -1, 1 + 2 * width)                # [b, 1+W, 1+2w]
        floats = np.ascontiguousarray(cells[..., : 1 + width]).view(np.float64)
        return cls(floats[..., 0], floats[..., 1:], cells[..., 1 + width:])


@dataclass(frozen=True)
class Packed:
    """Host side: the columns of one iteration's result (numpy views, no copies)."""

    emitted: np.ndarray   # [b, W]
    n_emit: np.ndarray    # [b]
    n_acc: np.ndarray     # [b]
    reason: np.ndarray    # [b]
    alive: np.ndarray     # [b] bool
    first: np.ndarray     # [b]
    n_ver: np.ndarray     # [b]
    logprobs: LogprobBlock | None = None   # only when the iteration computed logprobs

    @classmethod
    def unpack(cls, host: np.ndarray, logprobs: int | None = None) -> Packed:
        """Split a ``[b, W + 6 (+ logprob block)]`` host array into its columns; ``logprobs`` is the
        iteration's top-k width (None = no block)."""
        cols = host.shape[1]
        # W + 6 + (1 + W)(1 + 2w) columns with a block: solve for W
        w = cols - TRAILER if logprobs is None else (cols - TRAILER - 1 - 2 * logprobs) // (2 + 2 * logprobs)
        lp = None
        if logprobs is not None:
            assert w + TRAILER + logprob_columns(1 + w, logprobs) == cols, "packed layout mismatch"
            lp = LogprobBlock.unpack(host[:, w + TRAILER:], logprobs)
        c = {name: host[:, w + i] for i, name in enumerate(COLUMNS)}
        return cls(host[:, :w], c["n_emit"], c["n_acc"], c["reason"], c["alive"].astype(bool), c["first"],
                   c["n_ver"], lp)
