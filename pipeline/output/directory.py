"""The output directory and its exactly-once commit protocol.

Layout::

    <output>/data/part-<run>-<seq>.parquet   committed rows (read the output as this directory)
    <output>/_tmp/                          files being written; never output, wiped at start
    <output>/_job.json                      marker: this is an Orthrus output dir (+ current run)
    <output>/_lease.json                    the running job's exclusive lease (``lease.py``)
    <output>/_logs/                         crash reports (traceback of an unexpected failure)
    <output>/retried/                       error rows that --retry-errors took out of data/ (``repair.py``)
    <output>/summary.json, summary.png

Exactly once: the driver is the only writer. Each batch Ray Data hands it is written to ``_tmp``,
fsynced, then renamed into ``data/`` (``os.replace`` is atomic), so a part file is either complete
or absent. On resume the (id, sample_index) keys of every committed part are the finished set and
the preprocessing drops them before tokenization. A run killed at any point leaves only complete
parts; the rows it had in flight are simply not in the finished set and are generated again.

Object stores (``s3://``...) have no rename: ``object_output.py`` commits a part as one complete
object PUT at its final key instead; both classes share the reading side (:class:`CommittedParts`).

Write failures (disk full, permissions, a read-only mount): preflight proves the directory is
writable before any model loads; a write that fails later removes its temp file and raises
:class:`OutputWriteError`, so the directory still holds only complete parts and ``--resume``
continues once the cause is fixed. Every path written is ``<output>/<fixed name>`` or a part name
made of the run id and a counter; nothing taken from the data ever becomes a path.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pyarrow.parquet as pq

from pipeline.config import BehaviourConfig, ConfigError
from pipeline.storage.lease import LEASE, check_free
from pipeline.rows.schema import KEY_COLUMNS, OUTPUT_FIELDS, key_strings

DATA_DIR, TMP_DIR, MARKER, LOGS_DIR, RETRIED_DIR = "data", "_tmp", "_job.json", "_logs", "retried"
SUMMARY_JSON, SUMMARY_PNG = "summary.json", "summary.png"
_OURS = {DATA_DIR, TMP_DIR, MARKER, SUMMARY_JSON, SUMMARY_PNG, LOGS_DIR, RETRIED_DIR}   # replaced by --overwrite


class OutputWriteError(RuntimeError):
    """Writing into the output directory failed; what was committed before is complete."""


def new_run_id() -> str:
    """``<UTC start time>-<random>``: part names sort by the start of the run that wrote them."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommittedParts:
    """Reading the committed rows back (resume, repairs, summary): the part listing is the subclass's."""

    fs = None   # pyarrow filesystem of the part paths; None: local

    def part_files(self) -> list:
        raise NotImplementedError

    def read_part(self, part) -> pa.Table:
        """One committed part."""
        return pq.read_table(str(part), filesystem=self.fs)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All committed rows (optionally some columns only)."""
        files = [str(p) for p in self.part_files()]
        if not files:
            empty = pa.schema(OUTPUT_FIELDS).empty_table()
            return empty.select(columns) if columns else empty
        # Unified over every part: parts written before a column was added read it as null.
        schema = pa.unify_schemas([pq.read_schema(f, filesystem=self.fs) for f in files],
                                  promote_options="permissive")
        present = [c for c in columns if c in schema.names] if columns else None
        table = pds.dataset(files, format="parquet", schema=schema, filesystem=self.fs).to_table(columns=present)
        for name in columns or []:
            if name not in table.column_names:
                typ = next((f.type for f in OUTPUT_FIELDS if f.name == name), pa.null())
                table = table.append_column(pa.field(name, typ), pa.nulls(table.num_rows, typ))
        return table.select(columns) if columns else table

    def finished_keys(self) -> pa.Array:
        """Keys (id, sample_index) of every committed row: the resume skip set."""
        t = self.read(list(KEY_COLUMNS))
        return key_strings(t["id"], t["sample_index"]).combine_chunks() if t.num_rows else pa.array([], pa.string())

    def duplicates(self) -> tuple[int, str | None]:
        """Rows whose key appears earlier too, and one such id (0, None for an exactly-once output)."""
        keys = self.finished_keys()
        counts = pc.value_counts(keys) if len(keys) else None
        if counts is None or len(counts) == len(keys):
            return 0, None
        dup = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")[0].as_py()
        return len(keys) - len(counts), dup.split("\x1f")[0]

    def _check_existing(self, behaviour: BehaviourConfig, foreign: list[str], has_marker: bool) -> None:
        """A non-empty directory: allowed only as our own output, with resume or overwrite."""
        if not (behaviour.resume or behaviour.overwrite):
            raise ConfigError(f"output.path {self.root} already holds output; pass --resume to continue it "
                              "(behaviour.resume) or --overwrite to replace it (behaviour.overwrite)")
        if not has_marker or foreign:
            raise ConfigError(f"output.path {self.root} is not an Orthrus output directory (no {MARKER}"
                              f"{', has ' + foreign[0] if foreign else ''}); refusing to "
                              f"{'overwrite' if behaviour.overwrite else 'resume into'} it")
        if behaviour.resume and not behaviour.dedupe:
            count, example = self.duplicates()
            if count:
                raise ConfigError(f"output.path {self.root} holds {count} duplicate (id, sample_index) row(s), e.g. "
                                  f"{example!r} (two jobs once wrote to it at the same time); rerun with --dedupe to "
                                  "keep the first committed copy of each, then go on")

    def _lost_lease(self) -> OutputWriteError | None:
        if self.lease is not None and not self.lease.verify():
            return OutputWriteError(f"lost the lease on output.path {self.root} (another job holds it now); "
                                    f"stopped committing. The {self.committed} part file(s) this run committed are "
                                    "complete")
        return None


class OutputDir(CommittedParts):
    """One job's output directory (local or shared filesystem path)."""

    def __init__(self, path: str) -> None:
        self.root = Path(os.path.realpath(path))  # real paths: a symlink cannot hide output-in-input
        self.data, self.tmp, self.marker = self.root / DATA_DIR, self.root / TMP_DIR, self.root / MARKER
        self.run_id = new_run_id()
        self._seq = 0
        self.committed = 0  # part files this run committed
        self.lease = None   # the job's Lease (lease.py) once taken; a lost lease stops commits

    def _failed(self, what: str, error: Exception, tmp: Path | None) -> OutputWriteError:
        """Remove the half-written temp file and describe the failure."""
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself may have become unwritable; _tmp is wiped at start anyway
        reason = getattr(error, "strerror", None) or str(error)
        return OutputWriteError(f"cannot write {what} in output.path {self.root}: {reason} ({type(error).__name__}). "
                                f"The {self.committed} part file(s) this run committed are complete and nothing "
                                "partial was left; fix the cause (space, permissions) and rerun with --resume")

    def check(self, behaviour: BehaviourConfig, input_roots: tuple[str, ...], input_files: tuple[str, ...],
              model: str, input_scheme: str = "file") -> None:
        """Refuse unsafe or unwritable layouts before anything is written (leaves no trace)."""
        for root in map(Path, input_roots if input_scheme == "file" else ()):
            if _inside(self.root, root):
                raise ConfigError(f"output.path {self.root} is inside the input {root}; a rerun would read "
                                  "its own output. Choose a directory outside the inputs")
        inside = [f for f in input_files if input_scheme == "file" and _inside(Path(f), self.root)]
        if inside:
            raise ConfigError(f"input file {inside[0]} is inside output.path {self.root}")
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"output.path {self.root} exists and is not a directory")
        links = [n for n in sorted(_OURS | {LEASE}) if (self.root / n).is_symlink()]
        if links:  # a planted link would send writes (or an overwrite's deletes) outside the directory
            raise ConfigError(f"output.path {self.root}: {links[0]} is a symbolic link; refusing to write through it")
        if self.root.is_dir():
            check_free(self.root)
        if self.has_content():
            foreign = sorted(p.name for p in self.root.iterdir()
                             if p.name not in _OURS and not p.name.startswith(LEASE))
            self._check_existing(behaviour, foreign, self.marker.exists())
        self._probe()

    def _probe(self) -> None:
        """Create the directory and write, fsync and delete a file in it; undo what it created.

        Permission bits alone say nothing for root or on read-only mounts: only a real write tells,
        and it must tell now, before the model loads, not at the first commit hours later.
        """
        missing, p = [], self.root
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        created: list[Path] = []
        try:
            for d in reversed(missing):
                d.mkdir()
                created.append(d)
            fd, probe = tempfile.mkstemp(prefix=".orthrus-probe-", dir=self.root)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"output.path {self.root} is not writable: {e.strerror or e}"
                              f"{f' ({e.filename})' if e.filename else ''}") from None
        finally:
            for d in reversed(created):  # preflight leaves no trace
                try:
                    d.rmdir()
                except OSError:
                    pass

    def has_content(self) -> bool:
        """Whether the directory exists and holds more than a lease."""
        return self.root.is_dir() and any(not p.name.startswith(LEASE) for p in self.root.iterdir())

    def prepare(self, behaviour: BehaviourConfig, meta: dict) -> None:
        """Create (or clear, with overwrite) the directory, wipe stale temp files, write the marker."""
        if behaviour.overwrite and self.has_content():
            for name in _OURS:
                p = self.root / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a killed run: never committed
        try:
            self.data.mkdir(parents=True, exist_ok=True)
            self.tmp.mkdir(exist_ok=True)
        except OSError as e:
            raise self._failed("its directories", e, None) from e
        self.write_atomic(MARKER, json.dumps({"run_id": self.run_id, **meta}, indent=2).encode())

    @property
    def marker_exists(self) -> bool:
        return self.marker.exists()

    def recorded(self) -> dict:
        """The marker of the run that last wrote here ({} if none or unreadable)."""
        try:
            return json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return {}

    def write_atomic(self, name: str, payload: bytes) -> Path:
        """Write a top-level file so readers see the old or the new version, never half of one."""
        dest = self.root / name
        tmp = self.tmp / f"{name}.{uuid.uuid4().hex}"
        try:
            tmp.write_bytes(payload)
            os.replace(tmp, dest)
        except OSError as e:
            raise self._failed(name, e, tmp) from e
        return dest

    def part_files(self) -> list[Path]:
        """Committed part files, sorted."""
        return sorted(self.data.glob("part-*.parquet")) if self.data.is_dir() else []

    def commit(self, table: pa.Table) -> Path:
        """Atomically add one part file (temp file, fsync, rename)."""
        if (lost := self._lost_lease()) is not None:
            raise lost
        name = f"part-{self.run_id}-{self._seq:06d}.parquet"
        self._seq += 1
        self._write_part(self.data / name, table)
        self.committed += 1
        self._fsync_dir_of(self.data / name)
        return self.data / name

    def _write_part(self, dest: Path, table: pa.Table, times_ns: tuple[int, int] | None = None) -> None:
        """Write ``table`` to ``dest`` whole or not at all (temp file, fsync, rename); ``times_ns``:
        its (atime, mtime), set before the rename so that no crash leaves it with another."""
        tmp = self.tmp / (dest.name + f".{uuid.uuid4().hex[:8]}.inprogress")
        try:
            with open(tmp, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            if times_ns is not None:
                os.utime(tmp, ns=times_ns)
            os.replace(tmp, dest)
        except (OSError, pa.ArrowException) as e:
            raise self._failed(f"part file {dest.name}", e, tmp) from e

    def _fsync_dir_of(self, path: Path) -> None:
        try:
            fsync_dir(path.parent)  # the rename (or unlink) itself survives a machine crash
        except OSError as e:  # the part is complete and in place; only its durability is in doubt
            raise self._failed(f"(fsync) part file {path.name}", e, None) from e

    def replace_part(self, part: Path, keep: pa.Table) -> None:
        """Rewrite a committed part with only ``keep``'s rows, in one atomic step (a rename over it;
        deleted if ``keep`` is empty). It keeps its name and commit time, so commit order stays."""
        if (lost := self._lost_lease()) is not None:
            raise lost
        try:
            committed = part.stat()
            if not keep.num_rows:
                part.unlink()
        except OSError as e:
            raise self._failed(f"part file {part.name}", e, None) from e
        if keep.num_rows:
            self._write_part(part, keep, (committed.st_atime_ns, committed.st_mtime_ns))
        self._fsync_dir_of(part)

    def commit_order(self) -> list[Path]:
        """Committed parts, oldest commit first."""
        return sorted(self.part_files(), key=lambda p: (p.stat().st_mtime_ns, p.name))

    def archive(self, name: str, table: pa.Table) -> str:
        """Write ``table`` as ``retried/<name>`` (whole, then renamed) → where it went."""
        (self.root / RETRIED_DIR).mkdir(exist_ok=True)
        dest = self.root / RETRIED_DIR / name
        self._write_part(dest, table)
        self._fsync_dir_of(dest)
        return str(dest)

    def write_log(self, name: str, text: str) -> str:
        """Write ``_logs/<name>`` → where it went (raises OSError if it cannot)."""
        folder = self.root / LOGS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
        return str(folder / name)
