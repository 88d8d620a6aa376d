"""Derived row ids ``'<file name>:<row index>'`` for inputs without an id column.

Ray's ``read_parquet(include_paths=True, include_row_hash=True)`` gives every row its source path
and ``row_hash = splitmix64(md5(path)[:8] + row_index)`` (ray.data, datasource_v2
``synthesized_columns``). splitmix64's finaliser is a bijection, so the row index inside the file
is recovered exactly, however Ray split the file into blocks. ``tests/test_pipeline_ray.py``
pins this against real reads, and :func:`derive_ids` rejects any index outside the file, so a
change in Ray's formula fails loudly instead of producing wrong ids.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa

_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_INV1, _INV2 = np.uint64(pow(_C1, -1, 1 << 64)), np.uint64(pow(_C2, -1, 1 << 64))


def _unxorshift(x: np.ndarray, shift: int) -> np.ndarray:
    """Invert ``x ^= x >> shift`` on 64-bit words."""
    y = x.copy()
    k = shift
    while k < 64:
        y ^= x >> np.uint64(k)
        k += shift
    return y


def _path_seed(path: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.md5(path.encode("utf-8")).digest()[:8], "little"))


def row_indices(path: str, row_hashes: np.ndarray) -> np.ndarray:
    """Row indices (within ``path``) of rows whose Ray ``row_hash`` values are given."""
    x = np.asarray(row_hashes, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic is mod 2**64 by design
        x = _unxorshift(x, 31) * _INV2
        x = _unxorshift(x, 27) * _INV1
        return _unxorshift(x, 30) - _path_seed(path)


def derive_ids(paths: pa.Array | pa.ChunkedArray, row_hashes: pa.Array | pa.ChunkedArray,
               rows_per_file: dict[str, int]) -> list[str]:
    """``'<file name>:<row index>'`` for every row; ``rows_per_file`` bounds-checks the inversion."""
    path_list = paths.to_pylist()
    hashes = np.asarray(row_hashes.to_numpy(zero_copy_only=False), dtype=np.uint64)
    out: list[str] = [""] * len(path_list)
    for path in set(path_list):
        where = np.flatnonzero(np.asarray(path_list, dtype=object) == path)
        idx = row_indices(path, hashes[where])
        limit = rows_per_file.get(path)  # Ray reports the paths it was given (real paths)
        if limit is None or (idx >= np.uint64(limit)).any():
            raise RuntimeError(f"cannot derive row ids for {path}: Ray's row_hash no longer decodes to a row "
                               "index (did the Ray version change?); give the input an id column")
        name = os.path.basename(path)
        for i, r in zip(where, idx):
            out[i] = f"{name}:{int(r)}"
    return out
