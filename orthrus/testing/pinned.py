"""Policies pinned to one choice, for tests and benchmarks that must not follow wall time.

The engine's own policies (``engine/host/policy.py``) choose from measured step times, so two runs
may choose differently; these choose the same every time and still observe like the real ones.
Install them with :func:`pin`.
"""
from __future__ import annotations

from orthrus.engine.engine import OrthrusEngine
from orthrus.engine.host.policy import SpeculationPolicy, VerifyPolicy, halving_block_sizes


class PinnedVerify(VerifyPolicy):
    """Always verifies ``eighths`` (1-8) eighths of a cycle's drafts."""

    def __init__(self, eighths: int) -> None:
        super().__init__()
        self.pinned = eighths

    def choose(self, occupancy: int) -> int:
        """The pinned arm, counted like a choice."""
        self.chosen[self.pinned] = self.chosen.get(self.pinned, 0) + 1   # any share, not only the arms
        return self.pinned


class AlwaysSpeculate(SpeculationPolicy):
    """"auto" that always runs a cycle of the full block (where a sampled row's budget adapts)."""

    def choose(self, occupancy: int) -> int:
        """The largest block size."""
        return self.arms[1]


def pin(engine: OrthrusEngine, eighths: int | None, speculate: bool = False) -> OrthrusEngine:
    """Pin ``engine``'s verify budget to ``eighths`` of the drafts (None: leave its policy) and, with
    ``speculate``, its "auto" mode to full-block cycles → the engine."""
    if eighths is not None:
        engine.scheduler.speculation.verify_policies = {k: PinnedVerify(eighths) for k in range(2, engine.block_size + 1)}
    if speculate:
        engine.scheduler.speculation.policy = AlwaysSpeculate(halving_block_sizes(engine.block_size))
    return engine
