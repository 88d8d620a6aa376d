"""The one device→host transfer per iteration, described once: packed on the device, unpacked on the host.

Per row (int64): ``[emitted (W) | n_emit | n_acc | reason | alive_before | first | logprobs?]`` where
W is the iteration's block size (1 for an AR step), ``n_emit`` the tokens kept after stop truncation,
``n_acc`` the accepted drafts L, ``reason`` a :class:`FinishReason` code, ``alive_before`` whether
the row decoded in this iteration and ``first`` the token sampled at prefill (-1 when the row was
not just admitted). Only when some row of the iteration asked for logprobs, the logprob block of
``logprobs.py`` follows (``(1 + W) * (1 + 2w)`` columns at top-k width w); otherwise nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orthrus.engine.logprobs import LogprobBlock, block_columns

TRAILER = 5   # columns after the emitted tokens


def pack(emitted: torch.Tensor, n_emit: torch.Tensor, n_acc: torch.Tensor, reason: torch.Tensor,
         alive: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Device side: ``emitted [b, W]`` and five ``[b]`` columns → ``[b, W + 5]`` int64."""
    cols = torch.stack([n_emit, n_acc, reason, alive.long(), first], 1)
    return torch.cat([emitted, cols], 1)


@dataclass(frozen=True)
class Packed:
    """Host side: the columns of one iteration's result (numpy views, no copies)."""

    emitted: np.ndarray   # [b, W]
    n_emit: np.ndarray    # [b]
    n_acc: np.ndarray     # [b]
    reason: np.ndarray    # [b]
    alive: np.ndarray     # [b] bool
    first: np.ndarray     # [b]
    logprobs: LogprobBlock | None = None   # only when the iteration computed logprobs

    @classmethod
    def unpack(cls, host: np.ndarray, logprobs: int | None = None) -> "Packed":
        """Split a ``[b, W + 5 (+ logprob block)]`` host array into its columns; ``logprobs`` is the
        iteration's top-k width (None = no block)."""
        cols = host.shape[1]
        # W + 5 + (1 + W)(1 + 2w) columns with a block: solve for W
        w = cols - TRAILER if logprobs is None else (cols - TRAILER - 1 - 2 * logprobs) // (2 + 2 * logprobs)
        lp = None
        if logprobs is not None:
            assert w + TRAILER + block_columns(1 + w, logprobs) == cols, "packed layout mismatch"
            lp = LogprobBlock.unpack(host[:, w + TRAILER:], logprobs)
        return cls(host[:, :w], host[:, w], host[:, w + 1], host[:, w + 2], host[:, w + 3].astype(bool),
                   host[:, w + 4], lp)
