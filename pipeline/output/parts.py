"""Parts sized for storage, not for the engine: blocks stream into one open part until it is big
or old enough, then it commits as one whole file.

The engine's batch is the unit of work; the part is the unit of storage. A :class:`PartWriter`
takes every block the driver receives, buffers it into row groups of about
``ROW_GROUP_BYTES`` and writes them into one Parquet writer; it commits (footer with the part's
sources and aggregates, then the store's atomic step) when the part reaches ``output.part_bytes``
or has been open for ``output.part_seconds``. The lease is checked once per part. A kill loses at
most the open part, which is in no footer and so is generated again by ``--resume``.
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.output import stats as St
from pipeline.output.sources import SOURCES_KEY, PartSources, runs_of
from pipeline.storage.uris import STORE_ERRORS

ROW_GROUP_BYTES = 32 << 20


def write_part(out, dest: str, tables: list[pa.Table], schema: pa.Schema, sources: PartSources, stats: dict,
               times_ns=None) -> None:
    """Write ``tables`` as the part ``dest``, whole or not at all."""
    writer = _Open(out, dest, schema)
    try:
        for t in tables:
            writer.write(t)
        writer.close(sources, stats, times_ns)
    except BaseException:
        writer.abort()
        raise


class _Open:
    """One part being written: a Parquet writer on the store's sink."""

    def __init__(self, out, dest: str, schema: pa.Schema) -> None:
        self.out, self.dest = out, dest
        self.stream = self.tmp = None
        try:
            self.stream, self.tmp = out.store.sink(dest)
            self.writer = pq.ParquetWriter(self.stream, schema)
        except (*STORE_ERRORS, pa.ArrowException) as e:
            self.abort()
            raise out.failed(f"part file {dest.rsplit('/', 1)[-1]}", e) from e

    def write(self, table: pa.Table) -> None:
        try:
            self.writer.write_table(table, row_group_size=max(1, table.num_rows))
        except (*STORE_ERRORS, pa.ArrowException) as e:
            raise self.out.failed(f"part file {self.dest.rsplit('/', 1)[-1]}", e) from e

    def close(self, sources: PartSources, stats: dict, times_ns=None) -> None:
        try:
            self.writer.add_key_value_metadata({SOURCES_KEY: sources.encode(), St.STATS_KEY: St.encode(stats)})
            self.writer.close()
            self.out.store.finish(self.stream, self.tmp, self.dest, times_ns)
        except (*STORE_ERRORS, pa.ArrowException) as e:
            raise self.out.failed(f"part file {self.dest.rsplit('/', 1)[-1]}", e) from e

    def abort(self) -> None:
        self.out.store.abort(self.stream, self.tmp)


class PartWriter:
    """The driver's open part: ``add`` blocks, ``due`` says when to ``commit``."""

    def __init__(self, out, schema: pa.Schema, files: tuple[str, ...], n: int,
                 part_bytes: int, part_seconds: float) -> None:
        self.out, self.schema, self.files, self.n = out, schema, files, n
        self.part_bytes, self.part_seconds = part_bytes, part_seconds
        self._reset()

    def _reset(self) -> None:
        self._open: _Open | None = None
        self._buffer: list[pa.Table] = []
        self._coords: list[tuple[np.ndarray, np.ndarray]] = []     # (file index, flat index) per buffered row
        self._buffered = 0
        self._written = 0
        self._runs: list[np.ndarray] = []
        self._stats = St.empty()
        self._opened_at: float | None = None
        self.rows = 0

    def add(self, table: pa.Table, file_index: np.ndarray, rows: np.ndarray, samples: np.ndarray,
            prefill: dict | None = None) -> None:
        """Append output rows (already in the output schema), their coordinates, and the prefill
        counts of the batches they came from (``stats.prefill_of_block``)."""
        if not table.num_rows:
            return
        if self._open is None:
            self._open = _Open(self.out, self.out.new_part_path(), self.schema)
            self._opened_at = time.monotonic()
        self._coords.append((np.asarray(file_index, np.int64), np.asarray(rows, np.int64) * self.n + samples))
        self._stats = St.merge(self._stats, St.of_table(table, prefill))
        self._buffer.append(table)
        self._buffered += table.nbytes
        self.rows += table.num_rows
        if self._buffered >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Write the buffer as one row group, its rows in coordinate order: blocks arrive out of
        order (several actors, several batches each), and sorted rows make one run per stretch of
        a file instead of one per block, so footers stay small however many blocks a part holds."""
        if self._buffer:
            files = np.concatenate([f for f, _ in self._coords])
            flat = np.concatenate([x for _, x in self._coords])
            order = np.lexsort((flat, files))
            self._open.write(pa.concat_tables(self._buffer).take(pa.array(order)))
            self._runs.append(runs_of(files[order], flat[order]))
            self._written += self._buffered
            self._buffer, self._coords, self._buffered = [], [], 0

    def due(self) -> bool:
        """Whether the open part is big or old enough to commit."""
        if self._open is None:
            return False
        return (self._written + self._buffered >= self.part_bytes
                or time.monotonic() - self._opened_at >= self.part_seconds)

    def seconds_left(self) -> float | None:
        """Until the open part is due by age (None: no part open)."""
        if self._open is None:
            return None
        return max(0.0, self.part_seconds - (time.monotonic() - self._opened_at))

    def commit(self) -> int:
        """Commit the open part (if any) → rows committed."""
        if self._open is None:
            return 0
        rows = self.rows
        try:
            self.out.check_lease()
            self._flush()
            runs = np.concatenate(self._runs) if self._runs else np.zeros((0, 3), np.int64)
            used, local = np.unique(runs[:, 0], return_inverse=True)   # the footer names only its own files
            runs = np.column_stack([local.reshape(-1), runs[:, 1], runs[:, 2]]).astype(np.int64)
            sources = PartSources(self.n, tuple(self.files[i] for i in used.tolist()), _merge_adjacent(runs))
            self._open.close(sources, self._stats)
        except BaseException:
            self._open.abort()
            self._reset()
            raise
        self.out.committed += 1
        self._reset()
        return rows

    def abort(self) -> None:
        """Drop the open part (nothing of it becomes visible)."""
        if self._open is not None:
            self._open.abort()
        self._reset()


def _merge_adjacent(runs: np.ndarray) -> np.ndarray:
    """Join runs that continue each other (consecutive blocks of one file)."""
    if len(runs) < 2:
        return runs
    follows = (runs[1:, 0] == runs[:-1, 0]) & (runs[1:, 1] == runs[:-1, 1] + runs[:-1, 2])
    starts = np.flatnonzero(np.concatenate([[True], ~follows]))
    counts = np.add.reduceat(runs[:, 2], starts)
    return np.stack([runs[starts, 0], runs[starts, 1], counts], axis=1)
