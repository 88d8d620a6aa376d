"""The acceptance metrics, defined once (docs/design.md §2.4) and used by the engine, the trainer's
evaluation, the job summary and the benchmark.

*Tokens per cycle* (the acceptance length) = (accepted drafts + iterations) / iterations, an AR
step counting as an iteration that accepts 0 drafts; *TPF* (tokens per forward pass) = half of it.
"""
from __future__ import annotations


def tokens_per_cycle(accepted_drafts: float, iterations: float) -> float:
    """(accepted drafts + iterations) / iterations; 0 when there were none."""
    return (accepted_drafts + iterations) / iterations if iterations else 0.0


def acceptance_by_position(hist: list[int]) -> tuple[list[float], list[float]]:
    """From an accept-length histogram (``hist[L]`` = cycles accepting L drafts), per draft position
    j = 1 … K-1: P(draft j accepted) and P(draft j accepted | drafts before it accepted)."""
    cycles = sum(hist)
    if not cycles:
        return [], []
    reach = [sum(hist[j:]) for j in range(len(hist))]  # cycles that accepted at least j drafts
    rate = [reach[j] / cycles for j in range(1, len(hist))]
    cond = [reach[j] / reach[j - 1] if reach[j - 1] else 0.0 for j in range(1, len(hist))]
    return rate, cond
