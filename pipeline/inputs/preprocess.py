"""The job's CPU step before the processor: expand to the pending samples and build each one's request.

Runs as a Ray Data task over Arrow batches, right after the read tasks. Each pending
(id, sample_index) becomes one row in the processor's shape (``pipeline/requests/prepare.py``):
``prompt`` / ``messages`` from the configured columns, and its SamplingParams -- the config's
defaults overridden by the row's own columns (built once per distinct setting), with a seed
derived from (seed, id, sample_index) -- or the error of a row whose overrides or line
(``__input_error`` of JSONL inputs) are bad. The processor's prepare step then tokenizes, in the
same call (:func:`preprocess_batch`). Pass-through columns are cast to the inputs' unified types, so
blocks from files whose schemas differ concatenate.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orthrus import Constraint, SamplingParams
from orthrus.constraints import parse_constraint
from pipeline.config import ModelConfig, PromptConfig, SamplingConfig, StorageConfig
from pipeline.output.prefix_ideal import with_sketch
from pipeline.requests.request import REQUEST, prompt_ids
from pipeline.requests.prepare import PreparePlan, RowSampling, prepare_rows, values
from pipeline.requests.sampling_fields import (BY_ENGINE, FIELDS, Settings, as_int, build, frozen, parse, reseed,
                                              stop_with_structured)
from pipeline import schema as S
from pipeline.inputs.column_types import convert
from pipeline.inputs.plan import INPUT_ERROR, InputPlan
from pipeline.requests.errors import RowError, row_error
from pipeline.requests.prompts import ChatTemplate
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
    group: bool = False                # engine.prefix_grouping

    @property
    def prepare(self) -> PreparePlan:
        """The processor's prepare plan for this job."""
        return PreparePlan(self.model, self.storage, ChatTemplate.of(self.prompt), keep_inputs=False, group=self.group)


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


def settings_for(row: dict[str, Any], cfg: SamplingConfig, job: Constraint | None = None
                 ) -> tuple[SamplingParams, str | None]:
    """A row's SamplingParams less its seed -- config defaults, overridden by the row's non-null
    columns -- and the field its constraint came from (None: unconstrained). ``job``: ``cfg.structured`` parsed."""
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
    kw.update(stop=tuple(kw["stop"]), stop_token_ids=tuple(kw["stop_token_ids"]))
    kw["structured"], where = structured_for(row, job, cfg, kw["stop"])
    return build(kw, name), where


def _column(engine: str) -> str:
    return f"column {engine!r}"


def _row_ids(batch: pa.Table, plan: InputPlan) -> list[str]:
    if plan.id_column is not None:
        return pc.cast(batch[plan.id_column], pa.string()).to_pylist()
    return batch[S.DERIVED_ID].to_pylist()


def _expand(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(input row index, sample index) of every pending sample (the read task listed them)."""
    samples = batch[S.SAMPLES].combine_chunks()
    rows = pc.list_parent_indices(samples).to_numpy(zero_copy_only=False).astype(np.int64)
    return rows, pc.list_flatten(samples).to_numpy(zero_copy_only=False).astype(np.int64)


class _RowSettings:
    """Each input row's settings (less the seed), built once per distinct set of override values
    (:class:`Settings`), or the row's error. Bounded by the batch's rows."""

    def __init__(self, batch: pa.Table, plan: PreprocessPlan) -> None:
        names = (*plan.inputs.override_columns, STAGED_STRUCTURED, STRUCTURED_FIELD)
        self.overrides = {name: values(batch, name) for name in names if name != "seed"}
        self.line_errors = values(batch, INPUT_ERROR)
        self.options = {name: values(batch, name) for name in JOB_COLUMNS if name in batch.column_names}
        self.cfg, self.job = plan.sampling, parse_constraint(plan.sampling.structured)  # validated with the config
        self.settings = Settings()
        self.rows: dict[int, tuple[SamplingParams, str | None] | str] = {}

    def __call__(self, r: int) -> tuple[SamplingParams, str | None] | str:
        """Input row ``r``'s (settings, where its constraint came from), or its error message."""
        if r not in self.rows:
            self.rows[r] = self._build(r)
        return self.rows[r]

    def _build(self, r: int) -> tuple[SamplingParams, str | None] | str:
        if self.line_errors[r] is not None:
            return row_error(self.line_errors[r])
        for k, v in self.options.items():    # request options we do not implement: the error names the column
            if why := unsupported(k, v[r]):
                return f"column {k!r}: {why}"
        row = {k: v[r] for k, v in self.overrides.items()}
        try:
            return self.settings.get(frozen(row), lambda: settings_for(row, self.cfg, self.job))
        except RowError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a value of a type no check foresaw: the row's error
            return row_error("sampling override columns", e)


def _samples(batch: pa.Table, rows: np.ndarray, samples: np.ndarray, ids: list[str], plan: PreprocessPlan
             ) -> RowSampling:
    """Each pending sample's SamplingParams (its row's settings with the sample's own seed) or error."""
    settings = _RowSettings(batch, plan)
    seeds = values(batch, "seed") if "seed" in plan.inputs.override_columns else [None] * batch.num_rows
    params: list[SamplingParams | None] = []
    errors: list[str | None] = []
    fields: list[str | None] = []
    for r, s in zip(rows.tolist(), samples.tolist()):
        p, where, error = None, None, None
        built = settings(r)
        if isinstance(built, str):
            error = built
        else:
            try:
                p, where = reseed(built[0], _seed(seeds[r], plan.sampling.seed, ids[r], s), _column), built[1]
            except RowError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - e.g. a seed cell of an unforeseen type
                error = row_error("column 'seed'", e)
        params.append(p)
        errors.append(error)
        fields.append(where)
    return RowSampling(params, errors, fields)


@dataclass(frozen=True)
class JobRows:
    """The job's pending samples in the processor's row shape, and their sampling (already built:
    the prepare stage takes it as is)."""

    table: pa.Table
    sampling: RowSampling


def job_rows(batch: pa.Table, plan: PreprocessPlan) -> JobRows:
    """Input rows -> one row per pending (id, sample_index) in the processor's shape."""
    ids = _row_ids(batch, plan.inputs)
    rows, samples = _expand(batch)
    sampling = _samples(batch, rows, samples, ids, plan)
    take = pa.array(rows, pa.int64())
    cols = {"id": pa.array(ids, pa.string()).take(take), "sample_index": pa.array(samples, pa.int64()),
            S.FILE: batch[S.FILE].take(take), S.ROW: batch[S.ROW].take(take)}
    for name, column in (("prompt", plan.inputs.prompt_column), ("messages", plan.inputs.messages_column)):
        if column is not None and column in batch.column_names:
            cols[name] = batch[column].take(take)
    table = pa.table(cols)
    for field in plan.inputs.passthrough_fields:
        if field.name in batch.column_names:   # a column this batch's file lacks stays absent (nulls later)
            table = table.append_column(field, convert(batch[field.name], field.type).take(take))
    return JobRows(table, sampling)


def preprocess_batch(batch: pa.Table, plan: PreprocessPlan) -> pa.Table:
    """What the read tasks' rows become on their way to the actors: :func:`job_rows`, then the
    processor's prepare stage, in one call, so each row's SamplingParams is built once (the job's
    dataset runs it as its one preprocessing operator; the processor's own prepare map is skipped)."""
    start = time.time()
    rows = job_rows(batch, plan)
    table = prepare_rows(rows.table, plan.prepare, rows.sampling)
    table = with_sketch(table, prompt_ids(table[REQUEST]))      # the run's ideal prefill (summary.json)
    return _with_times(table, batch, start)


def _with_times(table: pa.Table, batch: pa.Table, start: float) -> pa.Table:
    """``table`` with ``schema.STARTUP`` on its first row: the earliest-read block of ``batch`` and
    this call's own start and end (the job's start-up split, ``report/startup.py``)."""
    read = {}
    if S.STARTUP in batch.column_names:
        found = [r for r in batch[S.STARTUP].drop_null().to_pylist() if r["read_end"] is not None]
        read = min(found, key=lambda r: r["read_end"]) if found else {}
    times = {"read_start": read.get("read_start"), "read_end": read.get("read_end"),
             "prepare_start": start, "prepare_end": time.time()}
    column = pa.array(([times] + [None] * (table.num_rows - 1)) if table.num_rows else [], S.STARTUP_TIMES)
    return table.append_column(pa.field(S.STARTUP, S.STARTUP_TIMES), column)
