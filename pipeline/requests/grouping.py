"""Prefix grouping: each prepared window of rows ordered by prompt token ids, so rows that share a
prefix reach the same actor together and meet in its prefix cache.

Why this order: sorted lexicographically, the longest prefix a row shares with any earlier row is
the one it shares with the row just before it, so an engine whose cache holds the most recent rows'
pages already holds each row's best match (SGLang's depth-first argument). Ordering within the
window the prepare task already holds costs no shuffle, no barrier and no start-up time; a global
sort would be a barrier over the whole dataset.

The order: prompts compared as token sequences (big-endian bytes of their non-negative ids, so byte
order is token order and a prefix sorts before its extensions), ties by input position (the n
samples of a row stay together, and the order is deterministic), rows without a request (error
rows) last, in input order. Rows carry their coordinates, so the output is unaffected: parts sort
by coordinate, and a row's seed is its own.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.requests.request import REQUEST, prompt_ids


def prompt_keys(prompts: pa.ListArray) -> list[bytes | None]:
    """Each prompt as sortable bytes (big-endian uint32 per token), None for a null prompt."""
    valid = prompts.is_valid().to_numpy(zero_copy_only=False)
    offsets = prompts.offsets.to_numpy()
    flat = np.asarray(prompts.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    raw = flat.astype(">u4").tobytes()     # [T] tokens -> 4T bytes, one buffer for the whole window
    return [raw[4 * offsets[i]:4 * offsets[i + 1]] if ok else None for i, ok in enumerate(valid.tolist())]


def prompt_order(prompts: pa.ListArray) -> np.ndarray:
    """The permutation that groups ``prompts``: by token sequence, ties by position, nulls last."""
    keys = prompt_keys(prompts)
    ranked = sorted((i for i, k in enumerate(keys) if k is not None), key=keys.__getitem__)   # stable: ties by position
    return np.asarray(ranked + [i for i, k in enumerate(keys) if k is None], dtype=np.int64)


def group_rows(table: pa.Table) -> pa.Table:
    """A prepared window (rows with ``__request``) in prefix-grouping order."""
    if table.num_rows < 2:
        return table
    return table.take(prompt_order(prompt_ids(table[REQUEST])))
