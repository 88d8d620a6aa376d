"""Batch-aware speculation (``speculative="auto"``): per iteration, a block size — or a plain AR step.

Every choice is exact (a cycle of any block size and an AR step start from, and leave, the same
per-row state), so the choice only moves speed. A cycle with block size k costs a draft and a
verify forward over k tokens per row and yields ``tokens_per_cycle(k)`` tokens; an AR step yields 1.
Which is fastest depends on how busy the device already is: at batch 1 a k-token forward costs
about as much as a 1-token one (weights are read once either way), at large batches it costs up to
k times more (compute bound). Smaller blocks lose little acceptance — most accepted drafts sit in
the first few positions — while costing less per cycle, so the arms are AR and the block sizes
K, K/2, K/4, … ≥ 2. Per occupancy bucket we measure each arm and pick the highest expected rate:

    rate(AR) = 1 / t_ar(b)          rate(k) = tokens_per_cycle(k) / t_cycle(k, b)

Costs are wall-clock per loop iteration (device work + the one sync), kept as the median of the
last ``window`` samples once there are ``min_samples``, so that one slow outlier on a shared
machine cannot lock a choice in (the first run of an arm at a bucket is a warm-up, not a sample:
on a GPU it includes the graph capture), and compared as ratios to the AR step of the same bucket.
A bucket where an arm is not measured yet borrows that arm's cost ratio from the nearest bucket
where it is (costs scale together), so exploring a new occupancy does not cost slow probes.
Losing arms are re-probed every ``reprobe`` decisions or less often — in proportion to how much
slower a probe of them is than the winner, 8× less when they are clearly behind, at most 16× less
— so a change in acceptance or load is noticed at a bounded price; AR, the cheapest check and the
anchor of every ratio, is re-measured every ``reprobe`` decisions while a block size wins.
Acceptance per arm is a decayed ratio of sums over live rows (not a mean of per-cycle means), so
one unlucky cycle does not flip the decision.

The same bandit chooses a cycle's verify budget (``VerifyPolicy``): its arms are fractions of the
block's drafts verified in all (the device spends them where the drafter is most confident,
``device/verify_budget.py``), its anchor is verifying every draft, and every arm's tokens per
cycle is measured (verifying fewer drafts accepts fewer).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from orthrus.engine.step import AR, occupancy_bucket   # AR: the arm of a plain AR step



def halving_block_sizes(block_size: int) -> tuple[int, ...]:
    """K, K/2, K/4, … down to 2: the speculative arms for a model drafting K-token blocks."""
    sizes = [block_size]
    while sizes[-1] // 2 >= 2:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


class ArmPolicy:
    """Chooses among ``arms`` (the anchor first) the one with the highest measured rate, tokens per
    iteration over wall time; ``anchor_tokens``: the anchor's tokens per iteration when it is known
    (1 for an AR step; None: measured like the others)."""

    def __init__(self, arms: Sequence[int], anchor_tokens: float | None, window: int = 9, min_samples: int = 3,
                 reprobe: int = 64, prior_tokens_per_cycle: float = 2.0, decay: float = 0.97,
                 margin: float = 0.05) -> None:
        self.arms: tuple[int, ...] = tuple(arms)
        self.anchor, self.anchor_tokens = self.arms[0], anchor_tokens
        self.window, self.min_samples, self.reprobe = window, min_samples, reprobe
        self.decay, self.margin = decay, margin
        self.cost: dict[tuple[int, int], float] = {}           # median of the recent samples
        self._samples: dict[tuple[int, int], deque[float]] = {}
        # decayed sums of (L + 1) and of live row-cycles, per arm whose yield is measured
        measured = [a for a in self.arms if a != self.anchor or anchor_tokens is None]
        self._tokens = {a: prior_tokens_per_cycle for a in measured}
        self._cycles = {a: 1.0 for a in measured}
        self.decisions = 0
        self._last: dict[int, dict[int, int]] = {}   # bucket -> arm -> decision at which it last ran
        self.chosen: dict[int, int] = {a: 0 for a in self.arms}

    @staticmethod
    def bucket(occupancy: int) -> int:
        """Occupancy bucket: the next power of two (costs grow smoothly in between)."""
        return occupancy_bucket(occupancy)

    def tokens_per_cycle(self, arm: int) -> float:
        """Current estimate of tokens per iteration (per row) of an arm."""
        if arm == self.anchor and self.anchor_tokens is not None:
            return self.anchor_tokens
        return self._tokens[arm] / self._cycles[arm]

    def _cost_ratio(self, arm: int, b: int) -> float | None:
        """t(arm) / t(anchor) at bucket ``b``, or at the nearest bucket where both were measured."""
        if arm == self.anchor:
            return 1.0
        measured = [k for (a, k) in self.cost if a == arm and (self.anchor, k) in self.cost]
        if not measured:
            return None
        near = b if b in measured else min(measured, key=lambda k: abs(math.log2(k) - math.log2(b)))
        return self.cost[(arm, near)] / self.cost[(self.anchor, near)]

    def _unexplored(self, b: int) -> int | None:
        """The next arm to measure: one with no cost ratio anywhere yet (in order); once it has run
        at this bucket, the anchor there, which gives it a ratio."""
        for arm in self.arms[1:]:
            if self._cost_ratio(arm, b) is None:
                return arm if (arm, b) not in self.cost else self.anchor
        return None

    def rate(self, arm: int, b: int) -> float:
        """Expected tokens per anchor-iteration-time of an arm at bucket ``b``."""
        ratio = self._cost_ratio(arm, b)
        return 0.0 if ratio is None else self.tokens_per_cycle(arm) / ratio

    def best(self, occupancy: int) -> int:
        """The arm with the highest expected rate at this occupancy (no exploration, no probes).
        Another arm must beat the anchor by ``margin``: the anchor is the baseline the choice
        promises not to lose to, and on a shared machine cost estimates move by several percent
        from one measurement to the next."""
        b = self.bucket(occupancy)
        if len(self.arms) == 1:
            return self.anchor
        other = max(self.arms[1:], key=lambda a: self.rate(a, b))
        return other if self.rate(other, b) > self.rate(self.anchor, b) * (1.0 + self.margin) else self.anchor

    def choose(self, occupancy: int) -> int:
        """The arm for an iteration over ``occupancy`` rows."""
        b = self.bucket(occupancy)
        self.decisions += 1
        last = self._last.setdefault(b, {a: self.decisions for a in self.arms})
        arm = self._unexplored(b)
        if arm is None:
            best = self.best(occupancy)
            probe = self._due_probe(best, b, last)
            arm = best if probe is None else probe     # (AR is 0: no truthiness tests on arms)
        self.chosen[arm] += 1
        last[arm] = self.decisions
        return arm

    def _due_probe(self, best: int, b: int, last: dict[int, int]) -> int | None:
        """A losing arm whose re-check at bucket ``b`` is due. Its interval grows with its cost relative
        to the winner's (a probe of a slow arm costs that much more) and 8x when it is clearly behind,
        so probing spends about 1/reprobe of the time on close contenders and far less on the rest."""
        def cost(a: int) -> float:
            ratio = self._cost_ratio(a, b)
            return 1.0 if ratio is None else ratio
        for arm in sorted(self.arms, key=lambda a: -self.rate(a, b)):
            if arm == best:
                continue
            if arm == self.anchor:   # the anchor of every ratio is re-measured on the plain interval
                interval = self.reprobe
            else:
                behind = self.rate(arm, b) < 0.8 * self.rate(best, b)
                interval = self.reprobe * min(16.0, max(1.0, cost(arm) / cost(best)) * (8 if behind else 1))
            if self.decisions - last[arm] >= interval:
                return arm
        return None

    def observe(self, arm: int, occupancy: int, seconds: float | None, tokens: int = 0, live_rows: int = 0) -> None:
        """Fold in one iteration's wall time (None: not the arm's alone, e.g. prompt chunks rode in
        its forward) and the live rows' summed tokens (L + 1)."""
        key = (arm, self.bucket(occupancy))
        if seconds is not None and key not in self._samples:   # an arm's first run at a bucket pays
            self._samples[key] = deque(maxlen=self.window)      # one-off costs (allocation, caches, capture)
        elif seconds is not None:
            self._samples[key].append(seconds)
            if len(self._samples[key]) >= self.min_samples:   # a ratio never rests on one sample
                self.cost[key] = statistics.median(self._samples[key])
        if arm in self._tokens and live_rows:
            self._tokens[arm] = self.decay * self._tokens[arm] + tokens
            self._cycles[arm] = self.decay * self._cycles[arm] + live_rows


class SpeculationPolicy(ArmPolicy):
    """Chooses the next iteration's block size (``AR`` = 0 for a plain step) from measured costs."""

    def __init__(self, block_sizes: Sequence[int]) -> None:
        if not block_sizes or min(block_sizes) < 2:
            raise ValueError(f"block sizes must be >= 2, got {tuple(block_sizes)}")
        super().__init__((AR, *sorted(set(block_sizes), reverse=True)), 1.0)


# A cycle's verify budget, in eighths of its drafts: all of them (the anchor), half, 3/8 (on the bundled
# model at B = 32-64: 2.1 drafts verified per accepted one at 2.5% fewer tokens per cycle), a quarter.
# Not an eighth: it never won there (-20% tokens per cycle), and every arm costs exploration cycles.
VERIFY_EIGHTHS = (8, 4, 3, 2)


class VerifyPolicy(ArmPolicy):
    """Chooses how many of a cycle's drafts it verifies in all, in eighths (``VERIFY_EIGHTHS``)."""

    def __init__(self) -> None:
        super().__init__(VERIFY_EIGHTHS, None)
