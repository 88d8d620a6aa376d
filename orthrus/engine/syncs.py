"""Counting device→host reads, so "one host sync per decode iteration" is a measured number.

Each read below blocks the host until the device has caught up (the tensor methods ``item``,
``tolist`` and ``cpu``, and Python's ``bool``/``int``/``float``/index conversions of a tensor, as
in ``if t.any():``). The decode loop's budget is one per iteration — the packed result in
``engine.py`` — and the tests and the benchmark check it with this counter. On a CPU nothing
actually waits, but the same calls are counted: they are the places that would sync on a GPU. It patches
``torch.Tensor`` for the duration of the ``with`` block only: a profiling tool, not for serving.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# (``numpy`` is not here: it only accepts host tensors, so the sync is the ``cpu`` call before it.)
HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")


def _counted(name: str, fn: Callable, counts: Counter) -> Callable:
    def counted(self, *args, **kwargs):
        counts[name] += 1
        return fn(self, *args, **kwargs)
    return counted


@contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Yield a Counter of device→host reads by kind, filled while the block runs."""
    counts: Counter = Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, _counted(name, getattr(torch.Tensor, name), counts))
        yield counts
    finally:
        for name, fn in own.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
