"""Host→device transfers of the decode loop: one staging buffer, one non-blocking copy per call.

``torch.as_tensor(a_list, device="cuda")`` copies from pageable host memory, and such a copy
synchronises the stream: with a dozen of them per admitting step (slots, prompts, lengths, every
sampling field) and one per iteration (the slot indices), the host would wait for the device that
many times while the loop's budget is one read per iteration. Here every piece of a transfer is
packed into one int64 host buffer (pinned on CUDA; floats travel as their float64 bit patterns,
bools as 0/1), copied with one ``non_blocking`` copy, and handed back as views of the device
buffer. Counted in ``transfers.COUNTS`` as ``h2d_async``.

Reuse: the host buffer is overwritten only after the previous copy out of it has finished (a CUDA
event, normally long done: each iteration's read-back drains the stream). A device buffer is
reused by the next call; the kernels queued on the views before it read them first (one stream).
"""
from __future__ import annotations

import numpy as np
import torch

from orthrus.engine.transfers import note_transfer


class HostStaging:
    """One pinned host buffer and its device twin, grown to the largest transfer seen."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=self.device)
        self._copied: torch.cuda.Event | None = None

    def _reserve(self, n: int) -> None:
        if n <= self._host.numel():
            return
        size = 1 << max(n - 1, 255).bit_length()   # powers of two: few reallocations, ever
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=self.pinned)
        self._dev = torch.empty(size, dtype=torch.int64, device=self.device)

    def stage(self, parts: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each host array (int, float64 or bool; any shape) → a device tensor of its shape and kind,
        all through one copy."""
        arrays = {name: np.asarray(a) for name, a in parts.items()}
        total = sum(a.size for a in arrays.values())
        self._reserve(total)
        if self._copied is not None:
            self._copied.synchronize()          # the last copy out of the host buffer is done
        host = self._host.numpy()
        offset, spans = 0, {}
        for name, a in arrays.items():
            flat = a.reshape(-1)
            if a.dtype.kind == "f":
                flat = flat.astype(np.float64).view(np.int64)
            host[offset: offset + a.size] = flat
            spans[name] = (offset, a.size, a.shape, a.dtype.kind)
            offset += a.size
        if total:
            self._dev[:total].copy_(self._host[:total], non_blocking=self.pinned)
            note_transfer()
            if self.pinned:
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))
        return {name: _view(self._dev[start: start + n], shape, kind) for name, (start, n, shape, kind) in spans.items()}


def _view(flat: torch.Tensor, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    out = flat.view(shape)
    if kind == "f":
        return out.view(torch.float64)
    if kind == "b":
        return out != 0
    return out
