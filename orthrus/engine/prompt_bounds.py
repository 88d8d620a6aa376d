"""Many prompts' lengths and id ranges at once, from Arrow's list layout (one flat id array and row
offsets): what :meth:`OrthrusEngine.check_requests` checks each row against, without one array per row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptBounds:
    """Per row: the prompt's length and its smallest and largest token id (0 and 0 when empty)."""

    lengths: np.ndarray
    lowest: np.ndarray
    highest: np.ndarray


def prompt_bounds(token_ids: np.ndarray, offsets: np.ndarray) -> PromptBounds:
    """Row ``i`` holds ``token_ids[offsets[i]:offsets[i + 1]]``; raises ``ValueError`` if the ids are not integers."""
    offsets = np.asarray(offsets, dtype=np.int64)
    flat = np.asarray(token_ids)
    if flat.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be an integer array, got {flat.dtype}")
    lengths = np.diff(offsets)
    lowest = np.zeros(len(lengths), np.int64)
    highest = np.zeros(len(lengths), np.int64)
    filled = np.flatnonzero(lengths > 0)
    if len(filled):   # empty rows hold no ids, so the segment from one filled start to the next is one row's
        base = offsets[filled[0]]
        ids = flat[base: offsets[-1]]
        lowest[filled] = np.minimum.reduceat(ids, offsets[filled] - base)
        highest[filled] = np.maximum.reduceat(ids, offsets[filled] - base)
    return PromptBounds(lengths, lowest, highest)
