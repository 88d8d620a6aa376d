"""The request column: a row's prompt token ids and sampling settings as one Arrow struct.

The prepare stage (``pipeline/processor/prepare.py``) builds it and the generation actor reads it
back, each with one call (:func:`to_arrow`, :func:`from_arrow`), so a new sampling field is one
edit here. A null request is a row that will not be generated (its ``error`` is set).
"""
from __future__ import annotations

import json

import pyarrow as pa

from orthrus import Constraint, SamplingParams
from orthrus.constraints import parse_constraint
from pipeline.rows.structured import constraint_json

REQUEST = "__request"
REQUEST_TYPE = pa.struct([
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int64()),
    pa.field("max_tokens", pa.int64()),
    pa.field("seed", pa.int64()),
    pa.field("stop", pa.list_(pa.string())),
    pa.field("stop_token_ids", pa.list_(pa.int64())),
    pa.field("logprobs", pa.int64()),
    pa.field("structured", pa.string()),      # JSON text of {kind: value}; null: unconstrained
])


# The job's ``sampling_params`` column: the same settings under vLLM's names (what the processor reads).
SAMPLING_TYPE = pa.struct([f for f in REQUEST_TYPE if f.name != "prompt_token_ids"])


def _sampling(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_tokens": p.max_new_tokens,
            "seed": p.seed, "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "logprobs": p.logprobs,
            "structured": constraint_json(p.structured)}


def sampling_to_arrow(params: list[SamplingParams | None]) -> pa.StructArray:
    """A ``sampling_params`` column (vLLM names); None becomes a null struct."""
    return pa.array([None if p is None else _sampling(p) for p in params], SAMPLING_TYPE)


def _row(prompt: list[int], p: SamplingParams) -> dict:
    return {"prompt_token_ids": prompt, **_sampling(p)}


def to_arrow(requests: list[tuple[list[int], SamplingParams] | None]) -> pa.StructArray:
    """One struct per row; None (a row that will not be generated) becomes a null struct."""
    return pa.array([None if r is None else _row(*r) for r in requests], REQUEST_TYPE)


def from_arrow(column: pa.Array | pa.ChunkedArray) -> list[tuple[list[int], SamplingParams] | None]:
    """Back to (prompt ids, SamplingParams) per row, None for null structs."""
    out: list[tuple[list[int], SamplingParams] | None] = []
    constraints: dict[str, Constraint] = {}   # rows of a batch often share one: parse its text once
    for r in column.to_pylist():
        if r is None:
            out.append(None)
            continue
        text = r["structured"]
        if text is not None and text not in constraints:
            constraints[text] = parse_constraint(json.loads(text))
        out.append((r["prompt_token_ids"], SamplingParams(
            temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"], max_new_tokens=r["max_tokens"],
            seed=r["seed"], stop=tuple(r["stop"]), stop_token_ids=tuple(r["stop_token_ids"]),
            logprobs=r["logprobs"], structured=None if text is None else constraints[text])))
    return out
