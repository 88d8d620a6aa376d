"""The one device→host transfer per iteration, described once: packed on the device, unpacked on the host.

Per row (int64): ``[emitted (W) | n_emit | n_acc | reason | alive_before | first]`` where W is the
iteration's block size (1 for an AR step), ``n_emit`` the tokens kept after stop truncation,
``n_acc`` the accepted drafts L, ``reason`` a :class:`FinishReason` code, ``alive_before`` whether
the row decoded in this iteration and ``first`` the token sampled at prefill (-1 when the row was
not just admitted).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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

    @classmethod
    def unpack(cls, host: np.ndarray) -> "Packed":
        """Split a ``[b, W + 5]`` host array into its columns."""
        w = host.shape[1] - TRAILER
        return cls(host[:, :w], host[:, w], host[:, w + 1], host[:, w + 2], host[:, w + 3].astype(bool),
                   host[:, w + 4])
