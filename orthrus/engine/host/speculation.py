"""What each iteration runs: its block size and its verify share, and what its time teaches the
policies that choose them (``policy.py``). Host only, numpy-free: a few comparisons per step."""
from __future__ import annotations

from dataclasses import dataclass

from orthrus.engine.host.policy import SpeculationPolicy, VerifyPolicy, halving_block_sizes
from orthrus.engine.host.slot_table import Recorded
from orthrus.engine.step import AR, Iteration, SamplingPaths


@dataclass(frozen=True)
class Choice:
    """One iteration's shape: its ``block`` (``AR``: a plain step), the arm the "auto" policy measures
    with it (None: none) and its verify share in eighths (None: every draft)."""

    block: int
    arm: int | None
    verify_eighths: int | None


class Speculation:
    """The mode (True: cycles of ``block_size``; False: AR steps; "auto": the policy's choice) and
    the policies behind it, which outlive requests: costs are a property of this engine on this
    device, acceptance of this model on this workload. ``adaptive_verify``: cycles verify a share of
    their drafts chosen by a ``VerifyPolicy`` per block size."""

    def __init__(self, block_size: int, mode: bool | str, adaptive_verify: bool) -> None:
        self.block_size, self.mode, self.adaptive_verify = block_size, mode, adaptive_verify
        self.policy: SpeculationPolicy | None = None     # created by the first "auto" step
        self.verify_policies: dict[int, VerifyPolicy] = {}

    def choose(self, occupancy: int, remaining: int, paths: SamplingPaths, constrained: bool) -> Choice:
        """The shape of an iteration over ``occupancy`` rows, the most tokens any of them may still
        take being ``remaining``."""
        chosen = self._block(occupancy)
        # A block longer than any row can still accept is wasted work. Capping it changes a sampled
        # row's random draws (the draft block's length is part of them), so a seeded row would
        # depend on its batch-mates' budgets; greedy rows are the same tokens at any block size,
        # and "auto" already picks the size by occupancy.
        block = _cap_block(chosen, remaining) if paths.all_greedy or self.mode == "auto" else chosen
        arm = chosen if self.mode == "auto" and block == chosen else None   # a capped block measures no arm
        return Choice(block, arm, self._verify(block, occupancy, paths, constrained))

    def observe(self, it: Iteration, seconds: float | None, rec: Recorded) -> None:
        """Fold in an iteration's wall time (None: not its own) and what its rows produced."""
        if it.arm is not None:
            self.policy.observe(it.arm, len(it.slots), seconds, rec.tokens, rec.live)
        if it.verify_eighths is not None:
            self.verify_policies[it.block].observe(it.verify_eighths, len(it.slots), seconds, rec.tokens, rec.live)

    def _block(self, occupancy: int) -> int:
        """The block size by the mode: K, AR, or the "auto" policy's choice."""
        if self.mode != "auto":
            return self.block_size if self.mode else AR
        if self.policy is None:
            self.policy = SpeculationPolicy(halving_block_sizes(self.block_size))
        return self.policy.choose(occupancy)

    def _verify(self, block: int, occupancy: int, paths: SamplingPaths, constrained: bool) -> int | None:
        """A cycle's verify share (the verify policy's choice), or None: every draft. Like the block
        size, it is part of a sampled row's draws and chosen from measured times: so it adapts only
        where output cannot depend on it (every row greedy) or already does ("auto"). A constrained
        cycle verifies every draft (its masks along the drafts come from the host)."""
        if not self.adaptive_verify or block == AR or constrained or not (paths.all_greedy or self.mode == "auto"):
            return None
        return self.verify_policies.setdefault(block, VerifyPolicy()).choose(occupancy)


def _cap_block(block: int, remaining: int) -> int:
    """A block never longer than the rows can still accept: a cycle of K emits at most K tokens, so
    with at most ``remaining`` left anywhere K shrinks to it (an AR step when one token is left)."""
    if block == AR or remaining >= block:
        return block
    return remaining if remaining >= 2 else AR
