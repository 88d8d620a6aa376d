"""The job's CPU step before the processor: expand to the pending samples and state each one's request.

Runs as a Ray Data task over Arrow batches, right after the read tasks. Each pending
(id, sample_index) becomes one row in the processor's shape (``pipeline/requests/prepare.py``):
``prompt`` / ``messages`` from the configured columns, a ``sampling_params`` struct (the config's
defaults overridden by the row's own columns, with a seed derived from (seed, id, sample_index)),
``__structured_field`` (where the row's constraint came from, for the prepare stage's compile
errors) and ``error`` for a row whose overrides or line (``__input_error`` of JSONL inputs) are bad. The
processor then tokenizes. Pass-through columns are cast to the inputs' unified types, so blocks
from files whose schemas differ concatenate.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orthrus import Constraint, SamplingParams
from orthrus.constraints import parse_constraint
from pipeline.config import ModelConfig, PromptConfig, SamplingConfig, StorageConfig
from pipeline.requests.prepare import PreparePlan, prepare_batch, values
from pipeline.requests.sampling_fields import BY_ENGINE, FIELDS, as_int, build, parse, stop_with_structured
from pipeline import schema as S
from pipeline.inputs.column_types import convert
from pipeline.inputs.plan import INPUT_ERROR, InputPlan
from pipeline.requests.errors import ERROR, RowError, row_error
from pipeline.requests.prompts import ChatTemplate
from pipeline.requests.request import sampling_to_arrow
from pipeline.requests.request_keys import JOB_COLUMNS, unsupported
from pipeline.requests.structured import STAGED_STRUCTURED, STRUCTURED, STRUCTURED_FIELD, Off, cell_constraint




@dataclass(frozen=True)
class PreprocessPlan:
    """Everything the job's preprocessing needs (shipped once per operator by Ray Data)."""

    inputs: InputPlan
    model: ModelConfig
    prompt: PromptConfig
    sampling: SamplingConfig
    storage: StorageConfig = StorageConfig()

    @property
    def prepare(self) -> PreparePlan:
        """The processor's prepare plan for this job."""
        return PreparePlan(self.model, self.storage, ChatTemplate.of(self.prompt), keep_inputs=False)


def derive_seed(base: int, row_id: str, sample_index: int) -> int:
    """A per-sample seed in [0, 2**63) that depends only on (base seed, id, sample index)."""
    digest = hashlib.blake2b(f"{base}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def structured_for(row: dict[str, Any], job: Constraint | None, cfg: SamplingConfig, stop: tuple[str, ...]
                   ) -> tuple[Constraint | None, str | None]:
    """The row's constraint (its ``structured`` cell, else the job's ``sampling.structured``, parsed
    as ``job``) and the field it came from; with stop strings or stop token ids, the row's error
    naming both (the engine refuses the pair: a stop could cut a record short)."""
    cell, where = row.get(STRUCTURED), f"column {STRUCTURED!r}"
    if cell is None:     # an OpenAI-batch row's: its body asked (staged with the field it came from)
        cell, where = row.get(STAGED_STRUCTURED), row.get(STRUCTURED_FIELD) or where
    c = cell_constraint(cell, where)
    if c is None and job is not None:
        c, where = job, "sampling.structured"
    if c is None or isinstance(c, Off):
        return None, None
    which = ("column 'stop'" if row.get("stop") is not None else "sampling.stop") if stop else \
        "sampling.stop_token_ids" if cfg.stop_token_ids else None
    if which:
        raise stop_with_structured(where, which)
    return c, where


def _seed(row_seed: Any, base: int, row_id: str, sample_index: int) -> int:
    """The sample's seed: the row's ``seed`` column + its index, else derived from the job's seed."""
    if row_seed is None:
        return derive_seed(base, row_id, sample_index)
    seed = as_int("column 'seed'", row_seed)   # checked before adding the index: all of a row's samples fail or none
    if not 0 <= seed < 2 ** 63:
        raise RowError(f"column 'seed' must be an int in [0, 2**63), got {seed}")
    return (seed + sample_index) % 2 ** 63


def sampling_for(row: dict[str, Any], sample_index: int, row_id: str, cfg: SamplingConfig,
                 job: Constraint | None = None) -> tuple[SamplingParams, str | None]:
    """The sample's SamplingParams -- config defaults, overridden by the row's non-null columns --
    and the field its constraint came from (None: unconstrained). ``job``: ``cfg.structured`` parsed."""
    given = {f.engine for f in FIELDS if f.column is not None and row.get(f.column) is not None}
    where: str | None = None

    def name(engine: str) -> str:
        f = BY_ENGINE.get(engine)
        if f is None:
            return engine
        if f.kind == "structured":
            return where or "sampling.structured"
        return f"column {f.column!r}" if engine in given else f"sampling.{f.config}"

    kw = {f.engine: parse(f, row[f.column], name(f.engine)) if f.engine in given else getattr(cfg, f.config)
          for f in FIELDS if f.kind != "structured" and f.engine != "seed"}
    kw.update(stop=tuple(kw["stop"]), stop_token_ids=tuple(kw["stop_token_ids"]),
              seed=_seed(row.get("seed"), cfg.seed, row_id, sample_index))
    kw["structured"], where = structured_for(row, job, cfg, kw["stop"])
    return build(kw, name), where


def _row_ids(batch: pa.Table, plan: InputPlan) -> list[str]:
    if plan.id_column is not None:
        return pc.cast(batch[plan.id_column], pa.string()).to_pylist()
    return batch[S.DERIVED_ID].to_pylist()


def _expand(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(input row index, sample index) of every pending sample (the read task listed them)."""
    samples = batch[S.SAMPLES].combine_chunks()
    rows = pc.list_parent_indices(samples).to_numpy(zero_copy_only=False).astype(np.int64)
    return rows, pc.list_flatten(samples).to_numpy(zero_copy_only=False).astype(np.int64)


def _samples(batch: pa.Table, rows: np.ndarray, samples: np.ndarray, ids: list[str], plan: PreprocessPlan
             ) -> tuple[list[SamplingParams | None], list[str | None], list[str | None]]:
    """Each pending sample's SamplingParams (or its row's error) and where its constraint came from."""
    columns = (*plan.inputs.override_columns, STAGED_STRUCTURED, STRUCTURED_FIELD)
    overrides = {name: values(batch, name) for name in columns}
    line_errors = values(batch, INPUT_ERROR)
    options = {name: values(batch, name) for name in JOB_COLUMNS if name in batch.column_names}
    job = parse_constraint(plan.sampling.structured)    # validated with the config: parsed once here
    params: list[SamplingParams | None] = []
    errors: list[str | None] = []
    fields: list[str | None] = []
    for r, s in zip(rows.tolist(), samples.tolist()):
        p, where, error = None, None, (row_error(line_errors[r]) if line_errors[r] is not None else None)
        if error is None:    # request options we do not implement: the row's error naming the column
            error = next((f"column {k!r}: {why}" for k, v in options.items() if (why := unsupported(k, v[r]))), None)
        if error is None:
            try:
                p, where = sampling_for({k: v[r] for k, v in overrides.items()}, s, ids[r], plan.sampling, job)
            except RowError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - e.g. the seed column's own checks
                error = row_error("sampling override columns", e)
        params.append(p)
        errors.append(error)
        fields.append(where)
    return params, errors, fields


def job_rows(batch: pa.Table, plan: PreprocessPlan) -> pa.Table:
    """Input rows -> one row per pending (id, sample_index) in the processor's shape."""
    ids = _row_ids(batch, plan.inputs)
    rows, samples = _expand(batch)
    params, errors, fields = _samples(batch, rows, samples, ids, plan)
    take = pa.array(rows, pa.int64())
    cols = {"id": pa.array(ids, pa.string()).take(take), "sample_index": pa.array(samples, pa.int64()),
            ERROR: pa.array(errors, pa.string()), "sampling_params": sampling_to_arrow(params),
            STRUCTURED_FIELD: pa.array(fields, pa.string()),    # read (and dropped) by the prepare stage
            S.FILE: batch[S.FILE].take(take), S.ROW: batch[S.ROW].take(take)}
    for name, column in (("prompt", plan.inputs.prompt_column), ("messages", plan.inputs.messages_column)):
        if column is not None and column in batch.column_names:
            cols[name] = batch[column].take(take)
    table = pa.table(cols)
    for field in plan.inputs.passthrough_fields:
        if field.name in batch.column_names:   # a column this batch's file lacks stays absent (nulls later)
            table = table.append_column(field, convert(batch[field.name], field.type).take(take))
    return table


def preprocess_batch(batch: pa.Table, plan: PreprocessPlan) -> pa.Table:
    """What the read tasks' rows become on their way to the actors: :func:`job_rows`, then the
    processor's prepare stage, in one call (the dataset runs them as two fused map operators)."""
    return prepare_batch(job_rows(batch, plan), plan.prepare)
