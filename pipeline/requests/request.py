"""The request column: a row's prompt token ids and sampling settings as one Arrow struct.

The prepare stage (``pipeline/requests/prepare.py``) builds it and the generation actor reads it
back, each with one call (:func:`to_arrow`, :func:`read_requests`), and both derive from the one table
of sampling fields (``sampling_fields.py``). A null request is a row that will not be generated (its ``error`` is set).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from orthrus import SamplingParams
from orthrus.constraints import parse_constraint
from pipeline.requests.sampling_fields import FIELDS, SAMPLING_TYPE, to_vllm
from pipeline.requests.structured import constraint_json

REQUEST = "__request"
# The prompt's token ids, then every sampling field under vLLM's names (``sampling_fields.FIELDS``;
# ``structured``: JSON text of {kind: value}, null: unconstrained).
REQUEST_TYPE = pa.struct([pa.field("prompt_token_ids", pa.list_(pa.int32())), *SAMPLING_TYPE])


def _sampling(p: SamplingParams) -> dict:
    return to_vllm(p, constraint_json(p.structured))


def _row(prompt: list[int], p: SamplingParams) -> dict:
    return {"prompt_token_ids": prompt, **_sampling(p)}


def to_arrow(requests: list[tuple[list[int], SamplingParams] | None]) -> pa.StructArray:
    """One struct per row; None (a row that will not be generated) becomes a null struct."""
    return pa.array([None if r is None else _row(*r) for r in requests], REQUEST_TYPE)


@dataclass(frozen=True)
class Requests:
    """A batch's request column read back column-wise: per row its prompt ids and SamplingParams
    (None for a null struct: a row that will not be generated), and the prompts as Arrow's list
    array, for checks that run column-wise (``OrthrusEngine.check_requests``)."""

    prompts: list[list[int] | None]
    params: list[SamplingParams | None]
    prompt_ids: pa.ListArray

    def __len__(self) -> int:
        return len(self.params)


def prompt_ids(column: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    """The request column's prompts as one list array, null where the request is null (a struct's
    child ignores the struct's validity; ``pc.struct_field`` does not)."""
    return pc.struct_field(_one_array(column), "prompt_token_ids")


def _one_array(column: pa.Array | pa.ChunkedArray) -> pa.StructArray:
    """The request column as one array (an empty batch's column has no chunks to combine)."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return pa.array([], REQUEST_TYPE) if isinstance(col, pa.ChunkedArray) else col


_SETTINGS = tuple(f for f in FIELDS if f.engine != "seed")    # shared by a job's rows; the seed is not


def read_requests(column: pa.Array | pa.ChunkedArray) -> Requests:
    """The request column → :class:`Requests`, one Arrow-to-Python conversion per field, not per row.

    Rows of a job share their settings except the seed, so each distinct setting builds (and
    validates) one SamplingParams, and each row takes it with its own seed (``with_seed``).
    """
    col = _one_array(column)
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    fields = {f.vllm: col.field(f.vllm).to_pylist() for f in FIELDS}
    ids = col.field("prompt_token_ids")
    prompts = ids.to_pylist()
    params: list[SamplingParams | None] = []
    shared: dict[tuple, SamplingParams] = {}
    for i, (ok, seed) in enumerate(zip(valid.tolist(), fields["seed"])):
        if not ok:
            prompts[i] = None
            params.append(None)
            continue
        key = tuple(tuple(v) if isinstance(v, list) else v for v in (fields[f.vllm][i] for f in _SETTINGS))
        if key not in shared:
            shared[key] = _params(*key)
        params.append(shared[key].with_seed(seed))
    return Requests(prompts, params, ids)


def _params(*values) -> SamplingParams:
    """A request struct's settings (in :data:`_SETTINGS` order) as SamplingParams."""
    kw = {f.engine: (tuple(v) if isinstance(v, list) else v) for f, v in zip(_SETTINGS, values)}
    structured = kw.pop("structured")
    return SamplingParams(**kw, structured=None if structured is None else parse_constraint(json.loads(structured)))


def from_arrow(column: pa.Array | pa.ChunkedArray) -> list[tuple[list[int], SamplingParams] | None]:
    """Back to (prompt ids, SamplingParams) per row, None for null structs."""
    r = read_requests(column)
    return [None if p is None else (ids, p) for ids, p in zip(r.prompts, r.params)]
