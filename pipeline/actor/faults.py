"""Test-only fault injection for the generation stage (off unless ``ORTHRUS_FAULT_INJECT`` is set).

The fault tests need an engine that runs out of memory on demand, on a CPU machine, without mocking
the engine. :class:`FaultyStage`, a subclass of the generation stage, consults a :class:`FaultInjector`
right before rows go into the engine and raises a real ``torch.OutOfMemoryError`` when a directive
matches, exactly as a CUDA OOM would surface from the engine. Directives (comma-separated)::

    oom_if_batch_gt:N   every generate call with more than N rows runs out of memory
    oom_on_id:ID        every generate call that holds the row with id ID runs out of memory
    sleep_per_batch:S   every batch takes S seconds longer (a slow device)
    hold_after:N:PATH   each actor runs its first N batches, then holds every later batch until the
                        file PATH exists (a barrier: a test orders its steps against a running job by
                        creating PATH, never by how long a batch takes; PATH never created = a device
                        that stalls, for the wall-time guard)

e.g. ``ORTHRUS_FAULT_INJECT=oom_if_batch_gt:2,oom_on_id:row-7``. The driver reads the variable
(:func:`stage_for`, from ``run/dataset.py``): set, the actors are a :class:`FaultyStage` given the
spec as a constructor argument, so it acts on every node; an active injector announces itself in
the actor log. No config carries it. Never set it in production.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from pipeline.actor.stage import GenerationStage, StagePlan

FAULT_ENV = "ORTHRUS_FAULT_INJECT"


def from_environment() -> str | None:
    """The driver's fault spec (None = off, the default)."""
    return os.environ.get(FAULT_ENV) or None


@dataclass(frozen=True)
class FaultInjector:
    """Parsed directives; :meth:`before_generate` raises when one matches."""

    max_rows: int | None = None
    oom_ids: frozenset[str] = frozenset()
    sleep_s: float = 0.0
    hold_after: int | None = None      # batches each actor runs before it waits for ``hold_file``
    hold_file: str | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "FaultInjector | None":
        """Parse a spec; a malformed one is an error (a silently ignored fault would fake a pass)."""
        if not spec:
            return None
        max_rows, ids, sleep_s, hold = None, set(), 0.0, (None, None)
        for item in spec.split(","):
            kind, sep, arg = item.strip().partition(":")
            count, _, path = arg.partition(":")
            if kind == "oom_if_batch_gt" and sep and arg.isdigit():
                max_rows = int(arg)
            elif kind == "oom_on_id" and sep and arg:
                ids.add(arg)
            elif kind == "sleep_per_batch" and sep and arg.replace(".", "", 1).isdigit():
                sleep_s = float(arg)
            elif kind == "hold_after" and count.isdigit() and path:
                hold = (int(count), path)
            else:
                raise ValueError(f"{FAULT_ENV}: cannot parse {item!r} (expected oom_if_batch_gt:N, oom_on_id:ID, "
                                 "sleep_per_batch:S or hold_after:N:PATH)")
        return cls(max_rows, frozenset(ids), sleep_s, *hold)

    async def slow_down(self) -> None:
        """Sleep ``sleep_per_batch`` seconds (without blocking the actor's other batches)."""
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)

    async def hold(self, batches_before: int) -> None:
        """Past the first ``hold_after`` batches, wait until ``hold_file`` exists (polled: the test that
        creates it is another process; the actor's other batches keep running meanwhile)."""
        if self.hold_file is None or batches_before < self.hold_after:
            return
        while not os.path.exists(self.hold_file):
            await asyncio.sleep(0.05)

    def before_generate(self, ids: list[str]) -> None:
        """Raise ``torch.OutOfMemoryError`` if this call must fail."""
        import torch        # in the actor (loaded there already); the driver only reads the spec

        if self.max_rows is not None and len(ids) > self.max_rows:
            raise torch.OutOfMemoryError(f"simulated out of memory ({FAULT_ENV}): {len(ids)} rows > "
                                         f"{self.max_rows}")
        hit = self.oom_ids.intersection(ids)
        if hit:
            raise torch.OutOfMemoryError(f"simulated out of memory ({FAULT_ENV}): batch holds row "
                                         f"{sorted(hit)[0]!r}")


class FaultyStage(GenerationStage):
    """The generation stage with faults injected (test-only): ``faults`` is an ``ORTHRUS_FAULT_INJECT`` spec."""

    wants_row_keys = True

    def __init__(self, plan: StagePlan, faults: str) -> None:
        self.faults = FaultInjector.parse(faults)
        self._batches = 0        # batches this actor has begun (hold_after counts them)
        super().__init__(plan)
        print(f"[orthrus] WARNING: fault injection active ({FAULT_ENV}={faults!r}); test-only", flush=True)

    async def _before_batch(self) -> None:
        if self.faults:
            self._batches += 1
            await self.faults.hold(self._batches - 1)
            await self.faults.slow_down()

    def _before_generate(self, ids: list[str]) -> None:
        if self.faults:
            self.faults.before_generate(ids)


def stage_for(stage_cls: type) -> tuple[type, dict]:
    """The actor class and its extra constructor arguments: :class:`FaultyStage` with the spec when
    ``ORTHRUS_FAULT_INJECT`` is set (a malformed spec fails here, in the driver), else ``stage_cls``."""
    spec = from_environment()
    if FaultInjector.parse(spec) is None:
        return stage_cls, {}
    if stage_cls is not GenerationStage:
        raise ValueError(f"{FAULT_ENV} is set, but the job runs the stand-in stage {stage_cls.__name__}")
    return FaultyStage, {"faults": spec}
