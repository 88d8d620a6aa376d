"""Counting device→host reads and host→device copies, so "one host sync per decode iteration" is a measured number.

Each read below blocks the host until the device has caught up (the tensor methods ``item``,
``tolist`` and ``cpu``, and Python's ``bool``/``int``/``float``/index conversions of a tensor, as
in ``if t.any():``). The decode loop's budget is one per iteration — the packed result read in
``device/runner.py`` — and the tests and the benchmark check it with this counter. On a CPU nothing
actually waits, but the same calls are counted: they are the places that would sync on a GPU. It patches
``torch.Tensor`` for the duration of the ``with`` block only: a profiling tool, not for serving.

Host→device copies are counted in the same Counter: ``h2d_async`` for the decode loop's one-copy
transfers through a staging buffer (``device/staging.py``, and the graphs' static slot buffer; the
engine counts these itself in ``orthrus.engine.transfers``, added here), and
``h2d`` for ``torch.as_tensor`` / ``torch.tensor`` of host data with a device: copies from pageable
memory, which synchronise a CUDA stream; and ``h2d_scalar`` for a Python number written into a
tensor by index (``t[idx] = -1``): on CUDA, PyTorch stages the value in a pageable host tensor and
copies it, a stream sync eagerly and a failed capture in a CUDA graph ("Cannot copy between CPU and
CUDA tensors during CUDA graph capture"; ``index_fill_`` takes the scalar as a kernel argument
instead). The loop's budget for ``h2d`` and ``h2d_scalar`` is zero. (A host tensor's
``.to(device)`` is not counted: on a CPU engine it cannot be told from a no-op ``.to`` of a device
tensor, which transformers' rotary embedding makes every layer; the engine stages its own.)
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from orthrus.engine import transfers

# (``numpy`` is not here: it only accepts host tensors, so the sync is the ``cpu`` call before it.)
HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
def host_reads(counts: Counter) -> int:
    """The device→host reads in a ``count_host_reads`` Counter (not its host→device copies); ``d2h``
    counts the reads made on purpose through a pinned buffer (a constrained cycle's drafts)."""
    return sum(counts[name] for name in HOST_READS) + counts["d2h"]


def _counted(name: str, fn: Callable, counts: Counter) -> Callable:
    def counted(self, *args, **kwargs):
        counts[name] += 1
        return fn(self, *args, **kwargs)
    return counted


def _factory(fn: Callable, counts: Counter) -> Callable:
    def counted(data, *args, **kwargs):
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            counts["h2d"] += 1             # host data (a list, numpy) copied to a device
        return fn(data, *args, **kwargs)
    return counted


def _setitem(fn: Callable, counts: Counter) -> Callable:
    def counted(self, index, value):
        if isinstance(value, (bool, int, float)):
            counts["h2d_scalar"] += 1      # a Python number staged on the host, then copied
        return fn(self, index, value)
    return counted


@contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Yield a Counter of device→host reads by kind, filled while the block runs."""
    counts: Counter = Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in (*HOST_READS, "__setitem__")}
    factories = {name: getattr(torch, name) for name in ("as_tensor", "tensor")}
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, _counted(name, getattr(torch.Tensor, name), counts))
        for name, fn in factories.items():
            setattr(torch, name, _factory(fn, counts))
        torch.Tensor.__setitem__ = _setitem(torch.Tensor.__setitem__, counts)
        before = transfers.COUNTS.copy()
        yield counts
    finally:
        counts.update(transfers.COUNTS - before)   # the engine's own transfers in the block
        for name, fn in factories.items():
            setattr(torch, name, fn)
        for name, fn in own.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
