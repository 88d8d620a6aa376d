"""The output directory on an object store (``s3://``, ``gs://``...): the layout of ``output.py``,
committed without renames.

An object store has no atomic rename, but every object PUT is atomic: readers see the whole new
object or none (a multipart upload only becomes an object when it completes). So a part is
serialised in memory and written with one PUT at its final, unique key
``data/part-<run>-<seq>.parquet``; an upload interrupted by a crash never becomes an object, so it
never counts as a part. ``_tmp/`` is not needed. Resume lists ``data/`` and reads the keys of the
committed parts exactly as on a local disk (:class:`pipeline.output.directory.CommittedParts`).

A repair rewrites a part by a PUT over the same key (atomic too), and the commit order of parts is
their name order (the run id starts with its start time), since an object's time changes when it is
rewritten. The exclusive writer is ``object_lease.py``'s.
"""
from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.config import BehaviourConfig, ConfigError
from pipeline.storage.object_lease import LEASES, check_free
from pipeline.output.directory import (_OURS, DATA_DIR, LOGS_DIR, MARKER, RETRIED_DIR, CommittedParts,
                             OutputWriteError, new_run_id)
from pipeline.storage.uris import STORE_ERRORS, Location, access_error


class ObjectOutputDir(CommittedParts):
    """One job's output prefix on an object store (same interface as :class:`pipeline.output.directory.OutputDir`)."""

    def __init__(self, loc: Location) -> None:
        self.loc, self.fs = loc, loc.fs
        self.root = loc.uri
        self.run_id = new_run_id()
        self._seq = 0
        self.committed = 0
        self.lease = None

    def _path(self, *names: str) -> str:
        return "/".join([self.loc.path, *names])

    def _top(self) -> list[str]:
        """Names directly under the prefix."""
        found = self.fs.get_file_info(pafs.FileSelector(self.loc.path, allow_not_found=True))
        return sorted(f.base_name for f in found)

    def _failed(self, what: str, error: Exception) -> OutputWriteError:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return OutputWriteError(f"cannot write {what} in output.path {self.root}: {reason}. The {self.committed} "
                                "part file(s) this run committed are complete and nothing partial was left; fix "
                                "the cause (access, quota) and rerun with --resume")

    def check(self, behaviour: BehaviourConfig, input_roots: tuple[str, ...], input_files: tuple[str, ...],
              model: str, input_scheme: str = "file") -> None:
        """Refuse unsafe or unwritable layouts before anything is written (leaves no trace)."""
        if input_scheme == self.loc.scheme:
            inside = lambda p, root: p == root or p.startswith(root.rstrip("/") + "/")  # noqa: E731
            for root in input_roots:
                if inside(self.loc.path, root):
                    raise ConfigError(f"output.path {self.root} is inside the input {root}; a rerun would read "
                                      "its own output. Choose a prefix outside the inputs")
            if any(inside(f, self.loc.path) for f in input_files):
                raise ConfigError(f"an input file is inside output.path {self.root}")
        try:
            top = self._top()
            if self.fs.get_file_info(self.loc.path).type == pafs.FileType.File:
                raise ConfigError(f"output.path {self.root} is an existing object, not a prefix")
            check_free(self.loc)
        except STORE_ERRORS as e:
            raise access_error("output.path", self.loc, "list", e) from None
        if [n for n in top if n != LEASES]:
            self._check_existing(behaviour, [n for n in top if n not in _OURS and n != LEASES], MARKER in top)
        self._probe()

    def _probe(self) -> None:
        """Write and delete one small object: the bucket exists and the credentials may write to it."""
        probe = self._path(f".orthrus-probe-{uuid.uuid4().hex}")
        try:
            with self.fs.open_output_stream(probe) as f:
                f.write(b"\0" * 16)
            self.fs.delete_file(probe)
        except STORE_ERRORS as e:
            raise access_error("output.path", self.loc, "write to", e) from None

    def prepare(self, behaviour: BehaviourConfig, meta: dict) -> None:
        """Clear the prefix (with overwrite) and write the marker."""
        try:
            if behaviour.overwrite:
                for name in self._top():
                    if name in _OURS:
                        info = self.fs.get_file_info(self._path(name))
                        if info.type == pafs.FileType.Directory:
                            self.fs.delete_dir(self._path(name))
                        else:
                            self.fs.delete_file(self._path(name))
        except STORE_ERRORS as e:
            raise self._failed("(clearing for --overwrite)", e) from e
        self.write_atomic(MARKER, json.dumps({"run_id": self.run_id, **meta}, indent=2).encode())

    @property
    def marker_exists(self) -> bool:
        return self.fs.get_file_info(self._path(MARKER)).type == pafs.FileType.File

    def recorded(self) -> dict:
        """The marker of the run that last wrote here ({} if none or unreadable)."""
        try:
            with self.fs.open_input_stream(self._path(MARKER)) as f:
                return json.loads(f.read())
        except (*STORE_ERRORS, ValueError):
            return {}

    def _put(self, path: str, payload: bytes | pa.Buffer, what: str) -> None:
        """One PUT: the object appears whole or not at all."""
        try:
            with self.fs.open_output_stream(path) as f:
                f.write(payload)
        except STORE_ERRORS as e:
            raise self._failed(what, e) from e

    def write_atomic(self, name: str, payload: bytes) -> str:
        """Write a top-level object (readers see the old or the new version)."""
        self._put(self._path(name), payload, name)
        return self._path(name)

    def part_files(self) -> list[str]:
        """Committed part objects, sorted (= commit order)."""
        found = self.fs.get_file_info(pafs.FileSelector(self._path(DATA_DIR), allow_not_found=True))
        return sorted(f.path for f in found if f.type == pafs.FileType.File
                      and f.base_name.startswith("part-") and f.base_name.endswith(".parquet"))

    def _serialise(self, table: pa.Table) -> pa.Buffer:
        try:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            return sink.getvalue()
        except pa.ArrowException as e:
            raise self._failed("a part file (serialising it)", e) from e

    def commit(self, table: pa.Table) -> str:
        """Add one part: one PUT of the whole Parquet file at a new key."""
        if (lost := self._lost_lease()) is not None:
            raise lost
        name = f"part-{self.run_id}-{self._seq:06d}.parquet"
        self._seq += 1
        self._put(self._path(DATA_DIR, name), self._serialise(table), f"part file {name}")
        self.committed += 1
        return self._path(DATA_DIR, name)

    def replace_part(self, part: str, keep: pa.Table) -> None:
        """Rewrite a committed part with only ``keep``'s rows (one PUT over it; deleted if empty)."""
        if (lost := self._lost_lease()) is not None:
            raise lost
        if keep.num_rows:
            self._put(part, self._serialise(keep), f"part file {part}")
            return
        try:
            self.fs.delete_file(part)
        except STORE_ERRORS as e:
            raise self._failed(f"(deleting) part file {part}", e) from e

    def commit_order(self) -> list[str]:
        """Committed parts in name order: by the UTC start time of the run that wrote them, then in
        the order that run committed them (an object's own time changes when a repair rewrites it)."""
        return self.part_files()

    def archive(self, name: str, table: pa.Table) -> str:
        """Write ``table`` as ``retried/<name>`` → its URI."""
        self._put(self._path(RETRIED_DIR, name), self._serialise(table), f"{RETRIED_DIR}/{name}")
        return f"{self.root}/{RETRIED_DIR}/{name}"

    def write_log(self, name: str, text: str) -> str:
        """Write ``_logs/<name>`` → its URI (raises OSError if it cannot)."""
        with self.fs.open_output_stream(self._path(LOGS_DIR, name)) as f:
            f.write(text.encode())
        return f"{self.root}/{LOGS_DIR}/{name}"
