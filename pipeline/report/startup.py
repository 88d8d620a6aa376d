"""Where the job's start-up goes: from the command to the first batch reaching an actor.

Every moment here is ``time.time()``, the wall clock: unlike ``perf_counter`` it is comparable
between the processes of one node (the driver, an actor, a read task), which is what the split
needs. Between nodes it is only as good as their clock sync, so a phase computed across two nodes
is clamped at 0 rather than reported negative.

The actor's chain is contiguous and adds up to ``total_s``:

    before_ray_s       process start -> ``ray.init`` begins (imports, config, input footers, tokenizer, lease)
    ray_start_s        ``ray.init`` on the driver
    actor_start_s      Ray up -> the first actor's constructor begins (the driver's plan, the actor
                       process's start and its imports)
    model_load_s       the constructor: checkpoint load, tokenizer, engine construction
    input_wait_s       the loaded actor -> its first batch (the input side was not ready yet)

The input side runs beside the actor's start, in other processes, so its two phases overlap the
chain instead of adding to it (their sum is at most ``total_s - before_ray_s - ray_start_s``):

    first_read_s       the read task of the first prepared rows (one Parquet row group)
    first_prepare_s    the preprocess call of the first batch (requests, chat template, tokenization;
                       the tokenizer's first load in that process included)

With several actors, the actor phases are the first actor's (the one that got the first batch).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

CHAIN = ("before_ray_s", "ray_start_s", "actor_start_s", "model_load_s", "input_wait_s")
INPUT_SIDE = ("first_read_s", "first_prepare_s")


def process_start() -> float | None:
    """When this process started (``time.time()`` scale), from ``/proc``; None where there is none."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: start time after boot
        with open("/proc/uptime") as f:
            # the seconds since boot now, to 10 ms (/proc/stat's boot time has whole seconds only)
            up = float(f.read().split()[0])
        return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class DriverClock:
    """The driver's start-up moments (``time.time()``); None where unknown (a caller that started Ray)."""

    command: float | None = field(default_factory=process_start)
    ray_init: float | None = None
    ray_ready: float | None = None

    def ray(self, start: Callable[[], str]) -> str:
        """Run ``start()`` (``ray.init``), noting when it began and ended; returns its result."""
        self.ray_init = time.time()
        try:
            return start()
        finally:
            self.ray_ready = time.time()


def earliest(records: list[dict | None], key: str) -> dict | None:
    """The record with the smallest non-null ``key`` (None if none has one)."""
    found = [r for r in records if r and r.get(key) is not None]
    return min(found, key=lambda r: r[key]) if found else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 3)


def startup_split(clock: DriverClock | None, constructed: dict | None, inputs: dict | None,
                  first_batch: float | None) -> dict[str, float | None]:
    """``summary.json["run"]["startup"]``: the phases (seconds, None where a moment is unknown).

    ``constructed``: the first actor's constructor ``{"start", "end"}``; ``inputs``: the first
    prepared rows' ``schema.STARTUP_TIMES``; ``first_batch``: when that actor got its first batch.
    """
    clock = clock or DriverClock(command=None)
    ctor = constructed or {}
    moments = [clock.command, clock.ray_init, clock.ray_ready, ctor.get("start"), ctor.get("end"), first_batch]
    split = {name: _span(a, b) for name, a, b in zip(CHAIN, moments, moments[1:])}
    got = inputs or {}
    split["first_read_s"] = _span(got.get("read_start"), got.get("read_end"))
    split["first_prepare_s"] = _span(got.get("prepare_start"), got.get("prepare_end"))
    split["total_s"] = _span(clock.command, first_batch)
    return split


def render_split(split: dict | None) -> list[str]:
    """The summary's start-up line (none when nothing is known)."""
    if not split or all(v is None for v in split.values()):
        return []
    f = lambda name: "n/a" if split.get(name) is None else f"{split[name]:.1f}"  # noqa: E731
    return [f"  start-up split before Ray {f('before_ray_s')} s | Ray {f('ray_start_s')} | actor start "
            f"{f('actor_start_s')} | model load {f('model_load_s')} | waiting for input {f('input_wait_s')} "
            f"= {f('total_s')} s from the command (beside the actor: first read {f('first_read_s')} s, first "
            f"prepare {f('first_prepare_s')} s)"]
