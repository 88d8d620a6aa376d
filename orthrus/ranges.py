"""Named ranges around the engine's parts, for profilers (``torch.profiler``, Nsight through its
NVTX export): the draft and verify forwards, the LM head, the prefill, the device-side masking and
the host grammar's work. ``jobs/bench/structured.py`` reads their exclusive times from a profile.

A range is a ``torch.profiler.record_function`` only while a profiler is recording; otherwise it
costs one check (~0.1 µs), and every range sits at call level (once per forward, kernel or grammar
call of an iteration, never per row), so decoding pays nothing measurable.

This module imports no torch: ``engine/host/`` uses it and must reach no torch
(tests/unit/test_engine_layout.py). It finds torch in ``sys.modules`` instead: a profiler can only
record where torch is imported, so a process without torch has no range to record.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

F = TypeVar("F", bound=Callable)
PREFIX = "orthrus."        # every range's name starts with it (a profile holds torch's own ops too)


def _recorder(name: str):
    """``record_function(PREFIX + name)`` while a torch profiler records, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.autograd._profiler_enabled():
        return None
    return torch.profiler.record_function(PREFIX + name)


@contextmanager
def ranged(name: str) -> Iterator[None]:
    """A named range around the ``with`` block (``orthrus.<name>`` in the profile)."""
    rec = _recorder(name)
    if rec is None:
        yield
        return
    with rec:
        yield


def named_range(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function is a named range (``orthrus.<name>``)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            rec = _recorder(name)
            if rec is None:
                return fn(*args, **kwargs)
            with rec:
                return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap
