"""Reading the inputs: a Ray Data datasource with one read task per (file, row group).

The driver only lists files and reads their footers (``plan.py``); every row is read here, in
Ray tasks. Each task reads one row group, so it knows each row's index in its file exactly: that
index is the row's coordinate in the output's part footers (``output/sources.py``), the base of a
derived id (``<file name>:<row index>``), and what resume filters on. A task is given only its own
file's finished ranges, so a resume ships no finished key anywhere: files that are done are not
read at all, untouched files are read in full, partially done files drop their finished samples
here.

A row group that cannot be read (a corrupt page), a value that does not fit the inputs' unified
column type, or a pass-through column the output cannot carry raises :class:`InputFileError`
naming the file and row group; the driver turns it into exit status 2 after committing what it
holds, and ``--resume`` continues once the file is fixed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline import schema as S
from pipeline.inputs.column_types import check_group, convert
from pipeline.inputs.plan import InputPlan
from pipeline.output.sources import Pending

INPUT_ERROR_MARK = "[orthrus input error]"


class InputFileError(ConfigError):
    """An input file that cannot be read or carried, found while the job runs."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{INPUT_ERROR_MARK} {message}")

    @property
    def message(self) -> str:
        """The message alone (Ray's wrappers of this error add their traceback around it)."""
        text = str(self)
        return text.split(INPUT_ERROR_MARK, 1)[1].strip().splitlines()[0] if INPUT_ERROR_MARK in text else text


@dataclass(frozen=True)
class ReadSpec:
    """What every read task needs of the plan (small: no file list travels with a task)."""

    schema: pa.Schema
    passthrough: tuple[str, ...]
    derive_ids: bool
    partition_base: str | None
    partition_columns: tuple[str, ...]
    filesystem: object | None

    @classmethod
    def of(cls, plan: InputPlan) -> "ReadSpec":
        return cls(plan.schema, plan.passthrough, plan.id_column is None, plan.partition_base,
                   plan.partition_columns, plan.filesystem)


@dataclass(frozen=True)
class RowGroupTask:
    """One read task: rows ``[offset, offset + num_rows)`` of ``path`` (= row group ``group``)."""

    file_index: int
    path: str
    group: int
    num_groups: int
    offset: int
    num_rows: int
    pending: Pending | None          # None: no sample of this file is committed yet


def read_row_group(task: RowGroupTask, plan: ReadSpec, n: int) -> pa.Table:
    """The task's rows with ``__file``, ``__row``, ``__samples`` (pending sample indices), the
    hive partition columns and, without an id column, the derived id; rows with no pending sample
    dropped."""
    where = f"row group {task.group} of {task.num_groups}"
    try:
        f = pq.ParquetFile(task.path, filesystem=plan.filesystem)
        group = f.read_row_group(task.group)
    except (OSError, pa.ArrowException) as e:
        raise InputFileError(f"input file {task.path} is corrupt ({where}): {type(e).__name__}: {e}") from None
    passthrough = [plan.schema.field(n_) for n_ in plan.passthrough]
    try:
        check_group(group, passthrough, task.path, first=task.group == 0)
    except ConfigError as e:
        raise InputFileError(str(e)) from None
    rows = np.arange(task.offset, task.offset + group.num_rows, dtype=np.int64)
    samples = (task.pending.samples(rows) if task.pending is not None
               else _all_samples(group.num_rows, n))
    keep = np.flatnonzero(np.diff(samples.offsets.to_numpy()) > 0)
    if len(keep) < group.num_rows:
        take = pa.array(keep, pa.int64())
        group, rows, samples = group.take(take), rows[keep], samples.take(take)
    cols = {name: _column(group, plan, name) for name in plan.schema.names if name in group.column_names}
    out = pa.table(cols)
    for key, value in _partition_values(task.path, plan).items():
        out = out.append_column(pa.field(key, pa.string()), pa.array([value] * out.num_rows, pa.string()))
    out = out.append_column(S.FILE, pa.array(np.full(out.num_rows, task.file_index, np.int32)))
    out = out.append_column(S.ROW, pa.array(rows))
    if plan.derive_ids:
        name = os.path.basename(task.path)
        out = out.append_column(S.DERIVED_ID, pa.array([f"{name}:{r}" for r in rows.tolist()], pa.string()))
    return out.append_column(S.SAMPLES, samples)


def _all_samples(num_rows: int, n: int) -> pa.ListArray:
    offsets = np.arange(0, (num_rows + 1) * n, n, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.tile(np.arange(n, dtype=np.int32), num_rows)))


def _column(group: pa.Table, plan: ReadSpec, name: str) -> pa.ChunkedArray:
    """Pass-through columns as the unified, view-free type (so blocks of all files concatenate);
    the consumed ones as read (the preprocessing checks their values row by row)."""
    col = group[name]
    if name in plan.passthrough:
        return convert(col, plan.schema.field(name).type)
    return col


def _partition_values(path: str, plan: ReadSpec) -> dict[str, str]:
    if not plan.partition_columns:
        return {}
    from ray.data.datasource.partitioning import Partitioning, PathPartitionParser

    found = PathPartitionParser(Partitioning("hive", base_dir=plan.partition_base))(path)
    return {k: found.get(k) for k in plan.partition_columns}


def row_group_tasks(plan: InputPlan, pending: dict[str, Pending | None]) -> list[RowGroupTask]:
    """A task per row group of every file with something pending (``pending`` lacks finished files).

    Bounded by files x row groups, as the driver's plan is.
    """
    tasks = []
    for index, (path, groups) in enumerate(zip(plan.files, plan.row_groups)):
        if path not in pending:
            continue
        offset = 0
        for g, rows in enumerate(groups):
            if rows:
                mine = pending[path].within(offset, offset + rows) if pending[path] is not None else None
                if mine is None or not mine.covers(offset, offset + rows):
                    tasks.append(RowGroupTask(index, path, g, len(groups), offset, rows, mine))
            offset += rows
    return tasks


def make_datasource(plan: InputPlan, pending: dict[str, Pending | None], n: int):
    """The Ray Data datasource over ``row_group_tasks`` (imports Ray lazily)."""
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    spec = ReadSpec.of(plan)

    class InputSource(Datasource):
        def __init__(self) -> None:
            super().__init__()
            self.tasks = row_group_tasks(plan, pending)

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
            return [ReadTask(lambda t=t: [_timed_read(t, spec, n)],
                             BlockMetadata(num_rows=t.num_rows, size_bytes=None, input_files=[t.path],
                                           exec_stats=None))
                    for t in self.tasks]

        def get_name(self) -> str:
            return "ReadInputs"

    return InputSource()


def _timed_read(task: RowGroupTask, spec: ReadSpec, n: int) -> pa.Table:
    """:func:`read_row_group` with when it ran on the block's first row (``schema.STARTUP``, its read
    fields; the preprocess step adds its own): the job's start-up split reads it (``report/startup.py``)."""
    start = time.time()
    table = read_row_group(task, spec, n)
    times = [{"read_start": start, "read_end": time.time()}] + [None] * (table.num_rows - 1)
    return table.append_column(pa.field(S.STARTUP, S.STARTUP_TIMES), pa.array(times[:table.num_rows], S.STARTUP_TIMES))


def read_file(plan: InputPlan, index: int, n: int) -> pa.Table:
    """All of input file ``index`` as the read tasks give it, nothing finished (tests and tools)."""
    path = plan.files[index]
    tasks = [t for t in row_group_tasks(plan, {path: None}) if t.path == path]
    if not tasks and plan.row_groups[index]:   # no rows, so no read task: its empty first group has the columns
        tasks = [RowGroupTask(index, path, 0, len(plan.row_groups[index]), 0, 0, None)]
    spec = ReadSpec.of(plan)
    return pa.concat_tables([read_row_group(t, spec, n) for t in tasks])
