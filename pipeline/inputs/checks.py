"""Distributed input checks: unique ids without a driver key set, and the opt-in full read.

Ids are the exactly-once and resume key, so no two rows may share one, and every row needs one.
The driver never holds them: one Ray task per file reads only that file's id column and checks
it (no nulls, valid text, unique within the file) and returns its count and its smallest and
largest id. Files whose [min, max] ranges do not overlap cannot share an id, which settles the
usual layouts (sorted or sharded ids) with nothing more. Files whose ranges do overlap go through a
hash-partitioned check: each file's task splits its ids into buckets by a hash, one reduce task
per bucket counts them, and only a duplicate (with the files holding it) comes back. The job runs
this while the actors load; the first commit waits for it, so a duplicate stops the job before
anything is committed.

``input.verify: full`` reads every row group of every file the way the read tasks will (one Ray
task per file), before any actor loads the model: a corrupt page or an uncarryable column then
stops the job up front instead of mid-run.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline.inputs.column_types import check_group
from pipeline.inputs.plan import InputPlan
from pipeline.inputs.staged_source import duplicate_across_sources, duplicate_in_source

_POWERS = np.array([pow(1099511628211, i, 1 << 64) for i in range(64)], dtype=np.uint64)


@dataclass(frozen=True)
class FileIds:
    """One file's ids, summarised: the error that stops the job, or its count and range."""

    path: str
    count: int = 0
    low: str | None = None
    high: str | None = None
    error: str | None = None


def _read_ids(path: str, column: str, fs) -> pa.ChunkedArray:
    try:
        col = pq.read_table(path, columns=[column], filesystem=fs)[column]
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"input file {path} is corrupt (id column {column!r}): {type(e).__name__}: {e}") from None
    try:
        col.validate(full=True)  # string ids: Parquet readers do not check UTF-8
    except pa.ArrowInvalid as e:
        raise ConfigError(f"input file {path}: id column {column!r} (input.id_column) holds invalid text: "
                          f"{e}") from None
    if col.null_count:
        first = pc.index(pc.is_null(col), True).as_py()
        raise ConfigError(f"input file {path}: {col.null_count} row(s) have a null {column!r} "
                          f"(input.id_column), first at row {first}; every row needs an id")
    return pc.cast(col, pa.string())


def _duplicate_error(column: str, count: int, example: str, files: list[str]) -> str:
    return (f"input column {column!r} (input.id_column) has {count} duplicate id(s), e.g. {example!r} "
            f"(in {' and '.join(files[:2])}); ids must be unique (they key exactly-once output and resume)")


def file_ids(path: str, column: str, fs) -> FileIds:
    """Check one file's ids (a Ray task) → its summary, or the error."""
    try:
        ids = _read_ids(path, column, fs)
    except ConfigError as e:
        return FileIds(path, error=str(e))
    counts = pc.value_counts(ids)
    dups = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if len(dups):
        named = duplicate_in_source(path, fs, ids, dups[0].as_py(), len(dups))
        return FileIds(path, error=named or _duplicate_error(column, len(dups), dups[0].as_py(), [path]))
    if not len(ids):
        return FileIds(path)
    bounds = pc.min_max(ids)
    return FileIds(path, len(ids), bounds["min"].as_py(), bounds["max"].as_py())


def bucket_of(ids: pa.Array, buckets: int) -> np.ndarray:
    """A hash bucket per string (FNV-style polynomial over the first 64 bytes), vectorised."""
    ids = pc.cast(ids, pa.large_string()).combine_chunks() if isinstance(ids, pa.ChunkedArray) \
        else pc.cast(ids, pa.large_string())
    offsets = np.frombuffer(ids.buffers()[1], np.int64)[ids.offset: ids.offset + len(ids) + 1]
    data = np.frombuffer(ids.buffers()[2], np.uint8)[offsets[0]: offsets[-1]].astype(np.uint64)
    lengths = np.diff(offsets)
    position = np.arange(len(data)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    with np.errstate(over="ignore"):
        terms = np.where(position < 64, data * _POWERS[np.minimum(position, 63)], 0).astype(np.uint64)
        sums = np.zeros(len(ids), np.uint64)
        nonempty = lengths > 0
        if nonempty.any():
            sums[nonempty] = np.add.reduceat(terms, (offsets[:-1] - offsets[0])[nonempty])
        return ((sums ^ (sums >> np.uint64(29))) % np.uint64(buckets)).astype(np.int64)


def split_ids(path: str, column: str, fs, buckets: int) -> list[pa.Array]:
    """One file's ids split into ``buckets`` by hash (a Ray task with ``buckets`` returns)."""
    ids = _read_ids(path, column, fs).combine_chunks()
    which = bucket_of(ids, buckets)
    parts = [ids.filter(pa.array(which == b)) for b in range(buckets)]
    return parts if buckets > 1 else parts[0]


def count_bucket(files: list[str], *parts: pa.Array) -> tuple[int, str | None, list[str]]:
    """Duplicates among one bucket's ids of every file → (count, an example, files holding it)."""
    ids = pa.chunked_array(parts, pa.string())
    counts = pc.value_counts(ids)
    dups = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if not len(dups):
        return 0, None, []
    example = dups[0].as_py()
    holders = [f for f, p in zip(files, parts) if pc.any(pc.equal(p, example)).as_py()]
    return len(dups), example, holders


def overlapping(summaries: list[FileIds]) -> list[str]:
    """Files whose [min, max] id range meets another file's (sorted sweep; bounded by files)."""
    ranged = sorted((s for s in summaries if s.count), key=lambda s: s.low)
    out: set[str] = set()
    group_high, holder = None, None
    for s in ranged:
        if group_high is not None and s.low <= group_high:
            out.update((s.path, holder))
        if group_high is None or s.high > group_high:
            group_high, holder = s.high, s.path
    return sorted(out)


class _Tasks:
    """Ray tasks when Ray is up; plain calls in this process otherwise (unit tests, tools).

    The checks run beside the job's own Ray Data tasks, which take every CPU they are given; tasks
    that asked for a CPU would wait behind them (seen: the first commit waited minutes). So they ask
    for none, and at most ``window`` run at once, which bounds what they add to the machine.
    """

    def __init__(self, num_cpus: float = 0, window: int = 4) -> None:
        import ray

        self.ray = ray if ray.is_initialized() else None
        self.num_cpus, self.window = num_cpus, window

    def call(self, fn, calls: list[tuple], num_returns: int = 1) -> list:
        """Submit ``fn(*args)`` per call, never more than ``window`` unfinished → refs (or results)."""
        if self.ray is None:
            return [fn(*args) for args in calls]
        task = self.ray.remote(fn).options(num_cpus=self.num_cpus, max_retries=3, num_returns=num_returns)
        refs, running = [], []
        for args in calls:
            if len(running) >= self.window:
                _, running = self.ray.wait(running, num_returns=1)
            ref = task.remote(*args)
            refs.append(ref)
            running.append(ref[0] if isinstance(ref, list) else ref)
        return refs

    def get(self, refs: list) -> list:
        return refs if self.ray is None else self.ray.get(refs)


def _id_window() -> int:
    """How many id tasks run at once: 4, fewer on a small cluster. Each running task holds a worker
    process, and a process started for it competes with the actors' start for the few cores (on 2
    cores, 4 of them cost the demo seconds before its first batch); one at a time reuses one."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 0) if ray.is_initialized() else 0
    return max(1, min(4, int(cpus) // 2))


def check_ids(plan: InputPlan) -> None:
    """Raise :class:`ConfigError` unless every row has an id and no two rows share one (Ray tasks)."""
    if plan.id_column is None:        # derived '<file name>:<row index>' ids are unique by construction
        return
    fs, column, tasks = plan.filesystem, plan.id_column, _Tasks(window=_id_window())
    summaries = tasks.get(tasks.call(file_ids, [(f, column, fs) for f in plan.files]))
    for s in summaries:
        if s.error:
            raise ConfigError(s.error)
    files = overlapping(summaries)
    if not files:
        return
    buckets = max(1, min(64, sum(s.count for s in summaries if s.path in files) // 1_000_000))
    refs = tasks.call(split_ids, [(f, column, fs, buckets) for f in files], num_returns=buckets)
    refs = [r if buckets > 1 else [r] for r in refs]
    found = tasks.get(tasks.call(count_bucket, [(files, *[r[b] for r in refs]) for b in range(buckets)]))
    total = sum(count for count, _, _ in found)
    if total:
        _, example, holders = next(f for f in found if f[0])
        named = duplicate_across_sources(holders, fs, column, example, total)
        raise ConfigError(named or _duplicate_error(column, total, example, holders))


def verify_file(path: str, plan: InputPlan) -> str | None:
    """Read every row group of ``path`` as the read tasks will → the error, or None (a Ray task)."""
    passthrough = [plan.schema.field(n) for n in plan.passthrough]
    where = "footer"
    try:
        f = pq.ParquetFile(path, filesystem=plan.filesystem)
        for g in range(f.num_row_groups):
            where = f"row group {g} of {f.num_row_groups}"
            check_group(f.read_row_group(g), passthrough, path, first=g == 0)
    except ConfigError as e:
        return str(e)
    except (OSError, pa.ArrowException) as e:
        return f"input file {path} is corrupt ({where}): {type(e).__name__}: {e}"
    return None


def verify_inputs(plan: InputPlan) -> None:
    """``input.verify: full``: every file read in full by Ray tasks; raise the first error."""
    tasks = _Tasks(num_cpus=1, window=1 << 30)       # before the dataset starts: the CPUs are free
    shared = tasks.ray.put(plan) if tasks.ray is not None else plan
    for error in tasks.get(tasks.call(verify_file, [(f, shared) for f in plan.files])):
        if error:
            raise ConfigError(error)
