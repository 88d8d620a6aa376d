"""Grammar masks on the device: staged from the host, expanded to the vocabulary, applied to logits.

Mask layout (llguidance's, ``host/grammar.py``): ``W = ceil(V / 32)`` int32 words per position; bit
``t % 32`` of word ``t // 32`` set = token ``t`` allowed. All-ones (-1) words = unconstrained.
Shape legend: ``n`` rows of one forward, ``K`` block size, ``W`` words, ``V`` vocabulary.
"""
from __future__ import annotations

import numpy as np
import torch

from orthrus.engine.device.staging import HostStaging
from orthrus.engine.step import DraftMasks
from orthrus.engine.transfers import note_transfer
from orthrus.ranges import named_range


def to_staged(bits: np.ndarray) -> np.ndarray:
    """int32 mask words → int64 pairs (the staging buffer's element), padded to an even count."""
    flat = np.ascontiguousarray(bits).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.full(1, -1, dtype=np.int32)])
    return flat.view(np.int64)


def from_staged(staged: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The device side of ``to_staged``: int64 pairs → int32 words of ``shape``."""
    n = int(np.prod(shape))
    return staged.view(torch.int32)[:n].view(shape)


def allowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mask words ``[..., W]`` int32 → ``[..., V]`` bool (token allowed)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab_size]


@named_range("device_masking")
def constrain(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` with the tokens the masks ``bits [..., W]`` refuse set to -inf (a copy)."""
    return logits.masked_fill(~allowed(bits, logits.shape[-1]), float("-inf"))


class IterationMasks:
    """One iteration's grammar masks on the device, for its rows ``[n]``.

    ``first [n, W]``: each row's mask for its next token, known before the iteration starts (staged
    with its indices). In a cycle, ``start(drafts)`` begins reading the drafts back and ``along()``
    finishes it: the masks ``[n, K, W]`` along the drafted path, computed on the host while the device
    runs the verify forward queued in between (on a GPU; a CPU does the two in turn).
    """

    def __init__(self, grammars: DraftMasks, rows: np.ndarray, first: torch.Tensor, staging: HostStaging,
                 readback: torch.Tensor) -> None:
        self.grammars, self.rows, self.first, self.staging = grammars, rows, first, staging
        self._readback = readback          # flat int64 host buffer, pinned on a GPU, reused every cycle
        self._drafts: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def start(self, drafts: torch.Tensor) -> None:
        """Queue the copy of ``drafts [n, K-1]`` to the host (pinned and asynchronous on a GPU)."""
        cuda = drafts.device.type == "cuda"
        self._drafts = self._readback[: drafts.numel()].view(drafts.shape)
        self._drafts.copy_(drafts, non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(drafts.device))

    def along(self) -> torch.Tensor:
        """The verify positions' masks ``[n, K, W]`` int32 on the device (one host→device copy)."""
        if self._copied is not None:
            self._copied.synchronize()      # SYNC: the constrained cycle's second read (its drafts)
        note_transfer("d2h")
        bits = self.grammars.path(self.rows, self._drafts.numpy())
        return from_staged(self.staging.stage({"bits": to_staged(bits)})["bits"], bits.shape)
