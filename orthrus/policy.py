"""Batch-aware speculation (``speculative="auto"``): per cycle, speculate or take a plain AR step.

Both choices are exact (a cycle and an AR step start from, and leave, the same per-row state), so
the choice only moves speed. A cycle costs a draft and a verify forward over K tokens per row and
yields ``tokens_per_cycle`` tokens; an AR step yields 1. Which is faster depends on how busy the
device already is: at batch 1 a K-token forward costs about as much as a 1-token one (memory
bound), at large batches it costs up to K times more (compute bound). So we measure both, per
occupancy bucket, and pick the larger expected tokens per second:

    speculate  iff  tokens_per_cycle × t_ar_step(b)  >  t_cycle(b)

Measurements are wall-clock per loop iteration (device work + the one sync), kept as
exponential moving averages. A bucket not measured yet borrows the cost ratio of the nearest
measured one (costs scale together), so exploring a new occupancy does not cost a slow probe; the
losing mode is re-probed every ``reprobe`` decisions so a change in acceptance or load is noticed.
Acceptance is a decayed ratio of sums over live rows (not a mean of per-cycle means), so one
unlucky cycle does not flip the decision.
"""
from __future__ import annotations

import math

SPEC, AR = "spec", "ar"


class SpeculationPolicy:
    """Chooses SPEC or AR for the next iteration from measured costs and observed acceptance."""

    def __init__(self, alpha: float = 0.2, reprobe: int = 32, prior_tokens_per_cycle: float = 2.0,
                 decay: float = 0.97) -> None:
        self.alpha, self.reprobe, self.decay = alpha, reprobe, decay
        self.cost: dict[tuple[str, int], float] = {}
        self._tokens, self._cycles = prior_tokens_per_cycle, 1.0   # decayed sums of (L + 1) and row-cycles
        self.decisions = 0
        self.chosen: dict[str, int] = {SPEC: 0, AR: 0}

    @staticmethod
    def bucket(occupancy: int) -> int:
        """Occupancy bucket: the next power of two (costs grow smoothly in between)."""
        return 1 << max(0, math.ceil(math.log2(max(occupancy, 1))))

    @property
    def tokens_per_cycle(self) -> float:
        """Current estimate of tokens per speculative cycle (per row)."""
        return self._tokens / self._cycles

    def _cost_ratio(self, b: int) -> float | None:
        """t_cycle / t_ar_step at bucket ``b``, or at the nearest bucket where both were measured."""
        measured = [k for (m, k) in self.cost if m == SPEC and (AR, k) in self.cost]
        if not measured:
            return None
        near = b if b in measured else min(measured, key=lambda k: abs(math.log2(k) - math.log2(b)))
        return self.cost[(SPEC, near)] / self.cost[(AR, near)]

    def choose(self, occupancy: int) -> str:
        """SPEC or AR for an iteration over ``occupancy`` rows."""
        b = self.bucket(occupancy)
        self.decisions += 1
        ratio = self._cost_ratio(b)
        if ratio is None:
            mode = SPEC if (SPEC, b) not in self.cost else AR       # explore the unmeasured one
        else:
            best = SPEC if self.tokens_per_cycle > ratio else AR
            other = AR if best == SPEC else SPEC
            # a clear winner is re-checked 8x less often: each probe of the loser costs real time
            clear = abs(self.tokens_per_cycle - ratio) > 0.25 * ratio
            mode = other if self.decisions % (self.reprobe * (8 if clear else 1)) == 0 else best
        self.chosen[mode] += 1
        return mode

    def observe(self, mode: str, occupancy: int, seconds: float, tokens: int = 0, live_rows: int = 0) -> None:
        """Fold in one iteration's wall time and, for SPEC, the live rows' summed (L + 1)."""
        key = (mode, self.bucket(occupancy))
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        if mode == SPEC and live_rows:
            self._tokens = self.decay * self._tokens + tokens
            self._cycles = self.decay * self._cycles + live_rows
