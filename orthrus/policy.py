"""Batch-aware speculation (``speculative="auto"``): per cycle, speculate or take a plain AR step.

Both choices are exact (a cycle and an AR step start from, and leave, the same per-row state), so
the choice only moves speed. A cycle costs a draft and a verify forward over K tokens per row and
yields ``tokens_per_cycle`` tokens; an AR step yields 1. Which is faster depends on how busy the
device already is: at batch 1 a K-token forward costs about as much as a 1-token one (memory
bound), at large batches it costs up to K times more (compute bound). So we measure both, per
occupancy bucket, and pick the larger expected tokens per second:

    speculate  iff  tokens_per_cycle × t_ar_step(b)  >  t_cycle(b)

Measurements are wall-clock per loop iteration (device work + the one sync), kept as
exponential moving averages; unknown buckets are explored, and the losing mode is re-probed every
``reprobe`` decisions so a change in acceptance or load is noticed.
"""
from __future__ import annotations

import math

SPEC, AR = "spec", "ar"


class SpeculationPolicy:
    """Chooses SPEC or AR for the next iteration from measured costs and observed acceptance."""

    def __init__(self, alpha: float = 0.2, reprobe: int = 32, prior_tokens_per_cycle: float = 2.0) -> None:
        self.alpha, self.reprobe = alpha, reprobe
        self.cost: dict[tuple[str, int], float] = {}
        self.tokens_per_cycle = prior_tokens_per_cycle
        self.decisions = 0
        self.chosen: dict[str, int] = {SPEC: 0, AR: 0}

    @staticmethod
    def bucket(occupancy: int) -> int:
        """Occupancy bucket: the next power of two (costs grow smoothly in between)."""
        return 1 << max(0, math.ceil(math.log2(max(occupancy, 1))))

    def choose(self, occupancy: int) -> str:
        """SPEC or AR for an iteration over ``occupancy`` rows."""
        b = self.bucket(occupancy)
        self.decisions += 1
        t_spec, t_ar = self.cost.get((SPEC, b)), self.cost.get((AR, b))
        if t_spec is None or t_ar is None:
            mode = SPEC if t_spec is None else AR                 # explore the unmeasured one
        else:
            best = SPEC if self.tokens_per_cycle * t_ar > t_spec else AR
            other = AR if best == SPEC else SPEC
            mode = other if self.decisions % self.reprobe == 0 else best
        self.chosen[mode] += 1
        return mode

    def observe(self, mode: str, occupancy: int, seconds: float, mean_tokens: float | None) -> None:
        """Fold in one iteration's wall time and, for SPEC, the live rows' mean (L + 1)."""
        key = (mode, self.bucket(occupancy))
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        if mode == SPEC and mean_tokens is not None and not math.isnan(mean_tokens):
            self.tokens_per_cycle = (1 - self.alpha) * self.tokens_per_cycle + self.alpha * mean_tokens
