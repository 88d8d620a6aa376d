"""Rows that each once killed a batch (the hardening tests' shard): hostile JSON and extreme values."""
from __future__ import annotations

import pyarrow as pa

from support.job_inputs import MSG

DEEP = "[" * 100_000 + "]" * 100_000                                   # legal JSON, deeper than Python recurses
HUGE_INT = '[{"role": "user", "content": "x", "n": %s}]' % ("9" * 5000)  # over Python's int-digit limit


def hostile_rows() -> tuple[pa.Table, dict[str, str | None]]:
    """One shard of rows that each once killed a batch; id -> expected error substring (None = fine)."""
    ids = ["ok", "deep-json", "huge-int-json", "top_k-u64", "max-f64", "seed-u64", "tiny-temp", "tiny-top-p"]
    table = pa.table({
        "id": ids,
        "messages": [MSG % "hi", DEEP, HUGE_INT] + [MSG % f"row {i}" for i in range(5)],
        "top_k": pa.array([None, None, None, 2 ** 64 - 1, None, None, None, None], pa.uint64()),
        "max_new_tokens": pa.array([None, None, None, None, 1e300, None, None, None], pa.float64()),
        "seed": pa.array([None, None, None, None, None, 2 ** 63, None, None], pa.uint64()),
        "temperature": pa.array([None] * 6 + [1e-300, 0.7], pa.float64()),
        "top_p": pa.array([None] * 7 + [1e-300], pa.float64()),
    })
    expected = {"ok": None, "deep-json": "messages is JSON this job cannot read: RecursionError",
                "huge-int-json": "messages is JSON this job cannot read: ValueError",
                "top_k-u64": "column 'top_k' holds 18446744073709551615, outside the 64-bit integer range",
                "max-f64": "column 'max_new_tokens' holds 1e+300, outside the 64-bit integer range",
                "seed-u64": "column 'seed' holds 9223372036854775808, outside the 64-bit", "tiny-temp": None, "tiny-top-p": None}
    return table, expected
