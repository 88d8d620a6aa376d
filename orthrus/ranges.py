"""Named ranges around the engine's parts, for profilers (``torch.profiler``; Nsight under
``torch.autograd.profiler.emit_nvtx``): the draft and verify forwards, the LM head, the prefill,
the device-side masking and the host grammar's work. ``jobs/bench/structured.py`` reads their
exclusive times from a profile.

A range is a ``torch.profiler.record_function`` only while a profiler is recording; otherwise it
costs a check (well under a microsecond), and every range sits at call level (once per forward,
kernel or grammar call of an iteration, never per row), so decoding pays nothing measurable.

A :class:`RangeTimer` (a benchmark's, never active in production) also times the ranges directly,
synchronising the device around each: the speed bench's draft / verify split of its timed runs,
cheaper than a profiler.

This module imports no torch: ``engine/host/`` uses it and must reach no torch
(tests/unit/test_engine_layout.py). It finds torch in ``sys.modules`` instead: a profiler can only
record where torch is imported, so a process without torch has no range to record.
"""
from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

F = TypeVar("F", bound=Callable)
PREFIX = "orthrus."        # every range's name starts with it (a profile holds torch's own ops too)
_timers: list[RangeTimer] = []        # the active RangeTimers: none outside a benchmark


class RangeTimer:
    """While entered: inclusive wall seconds per range name in ``seconds``, ``sync()`` (a device
    synchronisation, or nothing) called on both sides of every range."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.seconds: Counter = Counter()
        self.sync = sync or (lambda: None)

    def __enter__(self) -> RangeTimer:
        _timers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _timers.remove(self)


class _Timed:
    """One range as the active timers time it (around its profiler record, if one is recording)."""

    def __init__(self, name: str, rec) -> None:
        self.name, self.rec, self.start = name, rec, 0.0

    def __enter__(self) -> None:
        for t in _timers:
            t.sync()
        if self.rec is not None:
            self.rec.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        for t in _timers:
            t.sync()
        elapsed = time.perf_counter() - self.start
        if self.rec is not None:
            self.rec.__exit__(*exc)
        for t in _timers:
            t.seconds[self.name] += elapsed


_profiler_enabled: Callable[[], bool] | None = None     # torch.autograd._profiler_enabled, once torch is loaded
_compiling: Callable[[], bool] | None = None            # torch.compiler.is_compiling: dynamo traces no range
_NOTHING = nullcontext()                                # reusable: a range no one records


def _recorder(name: str):
    """What a range does now: ``record_function(PREFIX + name)`` while a torch profiler records,
    timed by the active RangeTimers if any; None (nothing at all) otherwise."""
    global _profiler_enabled, _compiling
    if _profiler_enabled is None:
        torch = sys.modules.get("torch")
        if torch is None:                   # no torch, no profiler
            return _Timed(name, None) if _timers else None
        _profiler_enabled, _compiling = torch.autograd._profiler_enabled, torch.compiler.is_compiling
    if _compiling():                        # torch.compile traces the work, never the profiling around it
        return None
    rec = sys.modules["torch"].profiler.record_function(PREFIX + name) if _profiler_enabled() else None
    return _Timed(name, rec) if _timers else rec


def ranged(name: str) -> AbstractContextManager:
    """A named range around a ``with`` block (``orthrus.<name>`` in the profile)."""
    return _recorder(name) or _NOTHING


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
