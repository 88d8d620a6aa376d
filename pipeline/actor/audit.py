"""The lossless audit: re-decode a fraction of greedy rows with plain AR and compare token for token.

The product's claim is that Orthrus output *is* the AR model's output. A run can show it on its
own data: each actor re-decodes the audited rows in a second engine in plain AR mode (same model
weights, its own small KV cache; ``engine_loop.py``) and records per row whether the ids are equal
(``audit_match``) and, if not, the index of the first token that differs
(``audit_first_divergence``). Rows are picked by a hash of their id, so a rerun or a resume audits
the same rows. Only greedy rows are audited: a sampled row equals AR in distribution, not in bits.

In float32/float64 every audited row matches (tested). In bf16/fp16 the verify forward (K tokens at
once) and an AR step (one token) round differently, so a near-tie can flip an argmax and the two
decodings part ways from there: that is reported, never hidden.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

AUDIT_COLUMNS = ("audit_match", "audit_first_divergence")


def is_audited(row_id: str, fraction: float) -> bool:
    """Whether ``row_id`` falls in the audited ``fraction`` (stable across runs and machines)."""
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8, person=b"orthrus-audit").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def first_divergence(speculative: Sequence[int], ar: Sequence[int]) -> int | None:
    """Index of the first generated token where the two decodings differ; None if they are equal.

    A decoding that is a strict prefix of the other diverges at its length (the other went on).
    """
    for i, (a, b) in enumerate(zip(speculative, ar)):
        if a != b:
            return i
    return None if len(speculative) == len(ar) else min(len(speculative), len(ar))


def audit_statistics(table: pa.Table, fraction: float, examples: int = 5) -> dict:
    """``summary.json["audit"]``: audited rows, exact matches and where divergences start."""
    if "audit_match" not in table.column_names:
        table = table.append_column("audit_match", pa.nulls(table.num_rows, pa.bool_()))
        table = table.append_column("audit_first_divergence", pa.nulls(table.num_rows, pa.int64()))
    audited = table.filter(pc.is_valid(table["audit_match"]))
    diverged = audited.filter(pc.invert(audited["audit_match"]))
    where = sorted(v for v in diverged["audit_first_divergence"].to_pylist() if v is not None)
    return {
        "fraction": fraction,
        "rows_audited": audited.num_rows,
        "exact_matches": audited.num_rows - diverged.num_rows,
        "diverged": diverged.num_rows,
        "first_divergence": ({"min": where[0], "median": where[len(where) // 2], "max": where[-1]}
                             if where else None),
        "diverged_examples": diverged.select(["id", "sample_index", "audit_first_divergence"]).slice(0, examples)
                                     .rename_columns(["id", "sample_index", "first_divergence"]).to_pylist(),
    }
