"""Where an engine run's time goes: exclusive seconds of the engine's named ranges
(``orthrus/ranges.py``) read from a ``torch.profiler`` profile of the run.

Exclusive: a range's time less the ranges nested in it (the grammar's host work inside nothing, the
device masking inside a prefill …), so the parts add up to at most the run's time and "rest" is the
remainder. The prefill's own forward and LM head count as prefill (the rule of the monkeypatching
timer this replaces: a cycle's forwards are what the forward parts compare).

CPU profile only: on a GPU the ranges measure the host's side of each call (launches, not kernel
time) unless the code inside synchronises; the run itself is synchronised at the end. Untested on CUDA.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from orthrus.ranges import PREFIX

PARTS = ("draft_forward", "verify_forward", "lm_head", "prefill", "host_masks_along_drafts", "host_matcher_advance",
         "host_matcher_admit", "device_masking", "rest")
FOLDED = {"prefill": {"draft_forward", "verify_forward", "lm_head"}}   # parent → children counted as the parent


def profiled(fn: Callable[[], Any], cuda: bool = False) -> tuple[Any, Counter]:
    """Run ``fn`` under a CPU ``torch.profiler`` → (its result, exclusive seconds by range name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    return out, exclusive_seconds(prof.events())


def _spans(events) -> list[tuple[int, float, float, str]]:
    """The named ranges of a profile as (thread, start µs, end µs, name), parents before children."""
    spans = [(e.thread, e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in events
             if e.name.startswith(PREFIX) and e.device_type == torch.autograd.DeviceType.CPU]
    return sorted(spans, key=lambda s: (s[0], s[1], -s[2]))


def exclusive_seconds(events) -> Counter:
    """Exclusive seconds per range name in the profiler ``events`` (see the module docstring)."""
    stack: list[list] = []     # [thread, end, name, child µs, folded, duration µs] of the open ranges
    totals: Counter = Counter()
    for thread, start, end, name in _spans(events):
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            _finish(stack.pop(), totals)
        folded = bool(stack) and (stack[-1][4] or name in FOLDED.get(stack[-1][2], ()))   # inside a fold too
        if stack and not folded:
            stack[-1][3] += end - start
        stack.append([thread, end, name, 0.0, folded, end - start])
    while stack:
        _finish(stack.pop(), totals)
    return Counter({name: us / 1e6 for name, us in totals.items()})


def _finish(span: list, totals: Counter) -> None:
    """A closed range: its time less its (unfolded) children's, unless it is itself folded."""
    _, _, name, child, folded, duration = span
    if not folded:
        totals[name] += duration - child
