"""The engine's deliberate transfers, counted (an integer add each, always on).

The staging buffers count each host→device copy they make (``h2d_async``), and a constrained cycle
its pinned read of the drafts (``d2h``). ``orthrus.testing.host_syncs`` adds these to the reads it
counts, so "one host sync per iteration" is a measured number; the engine itself never reads them.
"""
from __future__ import annotations

from collections import Counter

COUNTS: Counter[str] = Counter()


def note_transfer(kind: str = "h2d_async") -> None:
    """Count one transfer made on purpose."""
    COUNTS[kind] += 1
