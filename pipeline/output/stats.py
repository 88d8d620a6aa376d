"""A part's aggregates, kept in its footer, so the summary never reads a row.

``of_table`` computes them from output rows (vectorised; the driver does it once per block it
commits), plus the engine's prefill counts its batch records carried (``prefill_of_block``: not a
property of rows, so it rides on the block), ``merge`` adds two of them (every field is a sum, a
count map, a bounded list or a mergeable sketch), and ``report/summary.py`` turns the merged record
into ``summary.json``.
Row times are kept as log-bucketed sketches (1% relative error on quantiles, exact min and max):
a fixed-size, mergeable stand-in for every row's time.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.columns import SKETCHED, SUMMED
from pipeline.output import prefix_ideal

STATS_KEY = b"orthrus.stats"
EXAMPLES = 5
_GAMMA = 1.02            # sketch bucket ratio: quantiles within ~1%
# The columns summed over the ok rows, and those kept as sketches: the table's (``columns.py``).
SUMS: tuple[str, ...] = SUMMED
TIME_COLUMNS: tuple[str, ...] = SKETCHED
# The footers' engine aggregate (kept under "prefill"): its key -> the engine counter (``EngineStats``)
# the batch records' ``since`` holds, summed; then the KV page pool's figures, the largest kept.
PREFILL_FROM = {"computed_tokens": "prefill_tokens", "prefix_cache_hit_tokens": "prefix_cache_hit_tokens",
                "iterations": "iterations", "busy_slot_iterations": "busy_slot_iterations",
                "page_iterations": "page_iterations", "preemptions": "preemptions",
                "recomputed_tokens": "recomputed_tokens", "forward_token_slots": "forward_token_slots",
                "prefill_token_slots": "prefill_token_slots", "compile_ms": "compile_ms"}
KV_MAX_FROM = {"kv_page_size": "page_size", "kv_pages": "total", "kv_pages_peak": "peak"}
PREFILL_FIELDS = tuple(PREFILL_FROM)


def _sum(col) -> int:
    return int(pc.sum(col).as_py() or 0)


def sketch_of(values: np.ndarray) -> dict | None:
    """Log-bucketed counts of positive values (zeros in their own bucket), with exact min/max."""
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    positive = values[values > 1e-9]
    keys = np.ceil(np.log(positive) / math.log(_GAMMA)).astype(np.int64)
    uniq, counts = np.unique(keys, return_counts=True)
    return {"n": int(len(values)), "zeros": int(len(values) - len(positive)), "min": float(values.min()),
            "max": float(values.max()), "buckets": {str(k): int(c) for k, c in zip(uniq, counts)}}


def merge_sketch(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    buckets = dict(a["buckets"])
    for k, c in b["buckets"].items():
        buckets[k] = buckets.get(k, 0) + c
    return {"n": a["n"] + b["n"], "zeros": a["zeros"] + b["zeros"], "min": min(a["min"], b["min"]),
            "max": max(a["max"], b["max"]), "buckets": buckets}


def quantiles(sketch: dict | None) -> dict[str, float] | None:
    """p50, p90, p99 (within the sketch's relative error) and the exact max."""
    if sketch is None:
        return None
    keys = sorted((int(k), c) for k, c in sketch["buckets"].items())
    out = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        rank, seen, value = q * (sketch["n"] - 1), sketch["zeros"], 0.0
        if rank >= seen:
            for k, c in keys:
                seen += c
                if rank < seen:
                    value = 2 * _GAMMA ** k / (_GAMMA + 1)
                    break
        out[name] = round(min(max(value, sketch["min"]), sketch["max"]), 4)
    out["max"] = round(sketch["max"], 4)
    return out


def _column(table: pa.Table, name: str, typ: pa.DataType) -> pa.ChunkedArray:
    if name in table.column_names:
        return table[name]
    return pa.chunked_array([pa.nulls(table.num_rows, typ)], typ)


def _histogram(col: pa.ChunkedArray) -> list[int]:
    """Element-wise sum of per-row accept-length histograms (vectorised over the flattened lists)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    valid = col.filter(pc.is_valid(col))
    if not len(valid):
        return []
    values = pc.list_flatten(valid).to_numpy(zero_copy_only=False)
    position = np.asarray(pc.list_value_length(valid).to_numpy(zero_copy_only=False))
    index = np.arange(len(values)) - np.repeat(np.cumsum(position) - position, position)
    return np.bincount(index, weights=values, minlength=int(position.max(initial=0))).astype(np.int64).tolist()


def _speculation(ok: pa.Table) -> dict:
    spec = ok.filter(pc.greater(_column(ok, "num_cycles", pa.int64()), 0))
    tpc = spec["tokens_per_cycle"].to_numpy(zero_copy_only=False).astype(float) if spec.num_rows else np.zeros(0)
    weights = (spec["num_completion_tokens"].to_numpy(zero_copy_only=False).astype(float)
               if spec.num_rows else np.zeros(0))
    return {"spec_rows": spec.num_rows, "tpc_sum": float(tpc.sum()), "tpc_weighted_sum": float((tpc * weights).sum()),
            "tpc_weight": float(weights.sum())}


def _audit(table: pa.Table) -> dict:
    match = _column(table, "audit_match", pa.bool_())
    audited = table.filter(pc.is_valid(match))
    diverged = audited.filter(pc.invert(audited["audit_match"])) if audited.num_rows else audited
    where = [v for v in _column(diverged, "audit_first_divergence", pa.int64()).to_pylist() if v is not None]
    examples = (diverged.select(["id", "sample_index", "audit_first_divergence"]).slice(0, EXAMPLES)
                .rename_columns(["id", "sample_index", "first_divergence"]).to_pylist()) if diverged.num_rows else []
    return {"audited": audited.num_rows, "diverged": diverged.num_rows,
            "divergence_at": {str(k): where.count(k) for k in set(where)}, "diverged_examples": examples}


def prefill_of_block(block: pa.Table) -> dict | None:
    """The engine counts (:data:`PREFILL_FROM`) summed over a block's batch records, the page
    pool's size and peak (:data:`KV_MAX_FROM`, the largest), and under ``ideal`` the block's share
    of the run's ideal prefill (``prefix_ideal.of_block``); None when the block carries neither (a
    stand-in stage)."""
    ideal = prefix_ideal.of_block(block)
    out: dict = {} if ideal is None else {"ideal": ideal}
    if S.BATCH not in block.column_names or "since" not in block[S.BATCH].type.names:
        return out or None
    since = pc.struct_field(block[S.BATCH], "since")
    if not pc.count(since).as_py():
        return out or None
    out.update({key: _sum(pc.struct_field(since, counter)) for key, counter in PREFILL_FROM.items()})
    if "kv_pages" in block[S.BATCH].type.names:
        kv = pc.struct_field(block[S.BATCH], "kv_pages")
        out.update({key: pc.max(pc.struct_field(kv, f)).as_py() for key, f in KV_MAX_FROM.items()})
    return out


def _add_prefill(a: dict | None, b: dict | None) -> dict | None:
    """Two engine aggregates: counts add, pool figures keep the largest, the ideal's shares merge
    (keys a footer lacks: absent)."""
    if a is None or b is None:
        return a or b
    out = {}
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if name == "ideal":
            out[name] = prefix_ideal.merge(x, y)
        elif name in KV_MAX_FROM:
            out[name] = max((v for v in (x, y) if v is not None), default=None)
        else:
            out[name] = (x or 0) + (y or 0)
    return out


def of_table(table: pa.Table, prefill: dict | None = None) -> dict:
    """The aggregates of some output rows, with the prefill counts of the batches that made them
    (``prefill_of_block``; None: unknown)."""
    reason = _column(table, "finish_reason", pa.string())
    is_error = pc.fill_null(pc.equal(reason, "error"), False)
    ok, errors = table.filter(pc.invert(is_error)), table.filter(is_error)
    counts = pc.value_counts(reason) if table.num_rows else None
    times = {name: sketch_of(_column(ok, name, pa.float64()).to_numpy(zero_copy_only=False).astype(float))
             for name in TIME_COLUMNS}
    return {"rows": table.num_rows, "error": errors.num_rows,
            "finish_reason": dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
            if counts else {},
            "sums": {name: _sum(_column(ok, name, pa.int64())) for name in SUMS},
            "after_stop_known": "num_tokens_after_stop" in table.column_names,
            "speculation": _speculation(ok), "histogram": _histogram(_column(ok, "accept_length_histogram",
                                                                              pa.list_(pa.int64()))),
            "times": times, "audit": _audit(table), "prefill": prefill,
            "error_examples": [{"id": i, "error": e} for i, e in zip(
                _column(errors, "id", pa.string()).slice(0, EXAMPLES).to_pylist(),
                _column(errors, "error", pa.string()).slice(0, EXAMPLES).to_pylist())]}


def empty() -> dict:
    """The aggregates of no rows (``merge``'s identity)."""
    return of_table(pa.table({"id": pa.array([], pa.string()), "finish_reason": pa.array([], pa.string()),
                              "error": pa.array([], pa.string())}))


def _add_maps(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def merge(a: dict, b: dict) -> dict:
    """The aggregates of both sets of rows."""
    ha, hb = a["histogram"], b["histogram"]
    width = max(len(ha), len(hb))
    hist = [(ha[i] if i < len(ha) else 0) + (hb[i] if i < len(hb) else 0) for i in range(width)]
    return {"rows": a["rows"] + b["rows"], "error": a["error"] + b["error"],
            "finish_reason": _add_maps(a["finish_reason"], b["finish_reason"]),
            "sums": _add_maps(a["sums"], b["sums"]),
            "after_stop_known": a["after_stop_known"] or b["after_stop_known"],
            "speculation": _add_maps(a["speculation"], b["speculation"]), "histogram": hist,
            "times": {k: merge_sketch(a["times"].get(k), b["times"].get(k)) for k in TIME_COLUMNS},
            "audit": {"audited": a["audit"]["audited"] + b["audit"]["audited"],
                      "diverged": a["audit"]["diverged"] + b["audit"]["diverged"],
                      "divergence_at": _add_maps(a["audit"]["divergence_at"], b["audit"]["divergence_at"]),
                      "diverged_examples": (a["audit"]["diverged_examples"]
                                            + b["audit"]["diverged_examples"])[:EXAMPLES]},
            "prefill": _add_prefill(a.get("prefill"), b.get("prefill")),    # absent from older footers
            "error_examples": (a["error_examples"] + b["error_examples"])[:EXAMPLES]}


def encode(stats: dict) -> bytes:
    return json.dumps(stats).encode()


def decode(raw: bytes) -> dict:
    return json.loads(raw)


def column_sum(col: pa.ChunkedArray) -> int:
    """Sum of an integer column (0 when empty or all null)."""
    return int(pc.sum(col).as_py() or 0)


def prefix_cache_hit_rate(computed_tokens: int, hit_tokens: int) -> float | None:
    """The share of prompt tokens the prefix cache copied instead of prefilling (None: none yet)."""
    total = computed_tokens + hit_tokens
    return hit_tokens / total if total else None
