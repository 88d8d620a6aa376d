"""The output directory and its exactly-once commit protocol, over one of two part stores.

Layout::

    <output>/data/part-<run>-<seq>.parquet   committed rows (read the output as this directory)
    <output>/_tmp/                          files being written (local stores); never output, wiped at start
    <output>/_job.json                      marker: this is an Orthrus output dir (+ current run)
    <output>/_lease.json, _leases/          the running job's exclusive lease (``storage/lease.py``)
    <output>/_logs/                         crash reports (traceback of an unexpected failure)
    <output>/retried/                       error rows that --retry-errors took out of data/ (``repair.py``)
    <output>/_staged/                       JSONL inputs converted to Parquet (``inputs/staging.py``)
    <output>/summary.json, summary.png
    <output>/_SUCCESS                       completion marker: written last, only by a run that left every
                                            row x sample committed (``success.py``); removed at each start

Exactly once: the driver is the only writer, and a part appears whole or not at all (``store.py``:
a rename locally, one PUT on an object store). Each part's footer says which input rows it holds
(``sources.py``) and what they add up to (``stats.py``), so resume, the duplicate check and the
summary read footers, never rows. A run killed at any point leaves only complete parts; the rows it
had in flight are in no footer and are generated again.

Write failures (disk full, permissions, a read-only mount, a denied PUT): preflight proves the
directory writable before any model loads; a write that fails later leaves nothing partial and
raises :class:`OutputWriteError`, so ``--resume`` continues once the cause is fixed. Every path
written is ``<output>/<fixed name>`` or a part name made of the run id and a counter; nothing taken
from the data ever becomes a path.
"""
from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq

from pipeline.config import BehaviourConfig, ConfigError
from pipeline.output import stats as St
from pipeline.output.sources import SOURCES_KEY, DoneSet, PartSources
from pipeline.output.store import LocalStore, ObjectStore
from pipeline.schema import OUTPUT_FIELDS
from pipeline.storage.lease import LEASE, LEASES, check_free
from pipeline.storage.uris import STORE_ERRORS, is_remote, local_path, locate

DATA_DIR, TMP_DIR, MARKER, LOGS_DIR, RETRIED_DIR = "data", "_tmp", "_job.json", "_logs", "retried"
SUMMARY_JSON, SUMMARY_PNG = "summary.json", "summary.png"
SUCCESS = "_SUCCESS"                                           # completion marker (success.py)
STAGED_DIR = "_staged"                                         # JSONL inputs as Parquet (inputs/staging.py)
RESULTS_JSONL, ERRORS_JSONL = "results.jsonl", "errors.jsonl"   # output.format renderings (export.py)
_OURS = {DATA_DIR, TMP_DIR, MARKER, SUMMARY_JSON, SUMMARY_PNG, LOGS_DIR, RETRIED_DIR,
         RESULTS_JSONL, ERRORS_JSONL, STAGED_DIR, SUCCESS}   # replaced by --overwrite


class OutputWriteError(RuntimeError):
    """Writing into the output directory failed; what was committed before is complete."""


def new_run_id() -> str:
    """``<UTC start time>-<random>``: part names sort by the start of the run that wrote them."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


@dataclass(frozen=True)
class Footer:
    """What one committed part's footer says."""

    path: str
    sources: PartSources | None     # None: written before footers recorded sources
    stats: dict | None


def read_footer(path: str, fs) -> Footer:
    meta = pq.read_metadata(path, filesystem=fs).metadata or {}
    sources = PartSources.decode(meta[SOURCES_KEY]) if SOURCES_KEY in meta else None
    return Footer(path, sources, St.decode(meta[St.STATS_KEY]) if St.STATS_KEY in meta else None)


class OutputDir:
    """One job's output directory on a local filesystem or an object store."""

    def __init__(self, path: str, storage=None) -> None:
        from pipeline.config import StorageConfig

        remote = is_remote(path)
        self.store = (ObjectStore(locate(path, storage or StorageConfig(), "output.path")) if remote
                      else LocalStore(local_path(path)))
        self.root, self.fs = self.store.root, self.store.fs
        self.run_id = new_run_id()
        self._seq = 0
        self.committed = 0  # part files this run committed
        self.lease = None   # the job's lease (storage/lease.py) once taken; a lost lease stops commits

    def __getstate__(self) -> dict:
        """Picklable for repair tasks: the lease (and its heartbeat thread) stays with the driver."""
        return {**self.__dict__, "lease": None}

    @property
    def where(self):
        """What the lease is taken on: the local root, or the object-store location."""
        return self.store.root if self.store.local else self.store.loc

    @property
    def tmp(self):
        return self.store.tmp

    def failed(self, what: str, error: BaseException) -> OutputWriteError:
        """Describe a failed write (nothing partial was left by it)."""
        text = str(error).strip()
        reason = getattr(error, "strerror", None) or (text.splitlines()[0] if text else type(error).__name__)
        fix = "space, permissions" if self.store.local else "access, quota"
        return OutputWriteError(f"cannot write {what} in output.path {self.root}: {reason} ({type(error).__name__}). "
                                f"The {self.committed} part file(s) this run committed are complete and nothing "
                                f"partial was left; fix the cause ({fix}) and rerun with --resume")

    def check_lease(self) -> None:
        """Raise if another job holds the lease now (checked once per part commit)."""
        if self.lease is not None and not self.lease.verify():
            raise OutputWriteError(f"lost the lease on output.path {self.root} (another job holds it now); "
                                   f"stopped committing. The {self.committed} part file(s) this run committed are "
                                   "complete")

    # -- preflight ---------------------------------------------------------------------------------

    def check(self, behaviour: BehaviourConfig, input_roots: tuple[str, ...], input_files: tuple[str, ...],
              model: str, input_scheme: str = "file") -> None:
        """Refuse unsafe or unwritable layouts before anything is written (leaves no trace)."""
        same = input_scheme == ("file" if self.store.local else self.store.loc.scheme)
        mine = str(self.store.root) if self.store.local else self.store.loc.path
        inside = lambda p, root: p == root or p.startswith(root.rstrip("/") + "/")  # noqa: E731
        for root in input_roots if same else ():
            if inside(mine, root):
                raise ConfigError(f"output.path {self.root} is inside the input {root}; a rerun would read "
                                  "its own output. Choose a directory outside the inputs")
        bad = [f for f in input_files if same and inside(f, mine)]
        if bad:
            raise ConfigError(f"input file {bad[0]} is inside output.path {self.root}")
        self.store.refuse_unsafe(_OURS | {LEASE})
        try:
            top = self.store.top()
            check_free(self.where)
        except STORE_ERRORS as e:
            raise ConfigError(f"output.path {self.root} cannot be listed: {e}") from None
        content = [n for n in top if not n.startswith(LEASE) and n != LEASES]
        if content:
            foreign = [n for n in content if n not in _OURS]
            self._check_existing(behaviour, foreign, MARKER in top)
        self.store.probe()

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
                                  f"{example} (two jobs once wrote to it at the same time); rerun with --dedupe to "
                                  "keep the first committed copy of each, then go on")

    # -- top-level files ---------------------------------------------------------------------------

    def prepare(self, behaviour: BehaviourConfig, meta: dict) -> None:
        """Create (or clear, with overwrite) the directory, wipe stale temp files, write the marker.

        The completion marker goes first, before anything else changes: from this moment until this
        run completes, a sensor waiting for ``_SUCCESS`` must not take the directory as finished (a
        resume adds rows, a repair rewrites parts, an overwrite deletes them)."""
        try:
            self.clear_success()
            if behaviour.overwrite:
                for name in self.store.top():
                    if name in _OURS:
                        self.store.delete(self.store.path(name))
            self.store.make_dirs(DATA_DIR, TMP_DIR)
        except STORE_ERRORS as e:
            raise self.failed("its directories", e) from e
        self.write_atomic(MARKER, json.dumps({"run_id": self.run_id, **meta}, indent=2).encode())

    def clear_success(self) -> None:
        """Remove ``_SUCCESS`` if a completed run left one (a no-op otherwise)."""
        path = self.store.path(SUCCESS)
        if self.store.is_file(path):
            self.store.delete(path)

    @property
    def success_exists(self) -> bool:
        return self.store.is_file(self.store.path(SUCCESS))

    @property
    def marker_exists(self) -> bool:
        return self.store.is_file(self.store.path(MARKER))

    def recorded(self) -> dict:
        """The marker of the run that last wrote here ({} if none or unreadable)."""
        try:
            return json.loads(self.store.read_bytes(self.store.path(MARKER)))
        except (*STORE_ERRORS, ValueError):
            return {}

    def write_atomic(self, name: str, payload: bytes) -> str:
        """Write a top-level file so readers see the old or the new version, never half of one."""
        try:
            self.store.put(self.store.path(name), payload)
        except STORE_ERRORS as e:
            raise self.failed(name, e) from e
        return self.store.path(name)

    def write_log(self, name: str, text: str) -> str:
        """Write ``_logs/<name>`` → where it went (raises OSError if it cannot)."""
        if self.store.local:
            (self.store.root / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        self.store.put(self.store.path(LOGS_DIR, name), text.encode())
        return self.store.path(LOGS_DIR, name)

    # -- parts -------------------------------------------------------------------------------------

    def part_files(self) -> list[str]:
        """Committed part files, sorted by name."""
        return self.store.list_files(DATA_DIR, "part-", ".parquet")

    def commit_order(self) -> list[str]:
        """Committed parts, oldest commit first."""
        return sorted(self.part_files(), key=self.store.commit_time)

    def new_part_path(self) -> str:
        name = f"part-{self.run_id}-{self._seq:06d}.parquet"
        self._seq += 1
        return self.store.path(DATA_DIR, name)

    def footers(self, threads: int = 8) -> list[Footer]:
        """Every committed part's footer, in commit order, read in parallel (bounded by parts)."""
        parts = self.commit_order()
        if len(parts) <= 1:
            return [read_footer(p, self.fs) for p in parts]
        with ThreadPoolExecutor(max_workers=min(threads, len(parts))) as pool:
            return list(pool.map(lambda p: read_footer(p, self.fs), parts))

    def done(self) -> tuple[DoneSet, dict, list[Footer]]:
        """What the committed parts hold: their coordinates, merged aggregates, and the footers."""
        footers = self.footers()
        legacy = [f.path for f in footers if f.sources is None]
        if legacy:
            raise ConfigError(f"output.path {self.root}: part {legacy[0]} has no source record in its footer "
                              "(written by an older version of this job); resume it with that version or start "
                              "a new output")
        done, total = DoneSet(), St.empty()
        for f in footers:
            done.add(f.sources)
            total = St.merge(total, f.stats or St.empty())
        return done, total, footers

    def duplicates(self) -> tuple[int, str | None]:
        """Rows committed more than once, and where one is (0, None for an exactly-once output)."""
        done, _, footers = self.done()
        merged, twice = done.merged()
        if not twice:
            return 0, None
        return twice, _example_duplicate(footers, self.fs)

    def commit(self, table: pa.Table, sources: PartSources, stats: dict | None = None,
               dest: str | None = None, times_ns=None) -> str:
        """Write one whole part (a repair's rewrite, or a small commit) → its path."""
        from pipeline.output.parts import write_part

        self.check_lease()
        new = dest is None                   # a new part (not a repair's rewrite of one): counted
        dest = dest or self.new_part_path()
        write_part(self, dest, [table], table.schema, sources, stats or St.of_table(table), times_ns)
        self.committed += new
        return dest

    def read_part(self, part: str) -> pa.Table:
        return pq.read_table(part, filesystem=self.fs)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All committed rows (tests and tools; the job itself never reads rows back)."""
        files = self.part_files()
        if not files:
            empty = pa.schema(OUTPUT_FIELDS).empty_table()
            return empty.select(columns) if columns else empty
        schema = pa.unify_schemas([pq.read_schema(f, filesystem=self.fs) for f in files],
                                  promote_options="permissive")
        present = [c for c in columns if c in schema.names] if columns else None
        return pds.dataset(files, format="parquet", schema=schema, filesystem=self.fs).to_table(columns=present)


def _example_duplicate(footers: list[Footer], fs) -> str:
    """The id and sample index of one row that two parts (or one part twice) hold. Only on the
    error path: walks ranges pairwise until the first overlap, then reads one column of one part."""
    seen: dict[tuple[str, int], list] = {}
    for f in footers:
        position = 0
        for file_index, start, count in f.sources.runs.tolist():
            key = (f.sources.files[file_index], f.sources.n)
            for c, d in seen.get(key, []):
                lo = max(start, c)
                if lo < min(start + count, d):
                    row = pq.read_table(f.path, columns=["id", "sample_index"], filesystem=fs).slice(
                        position + lo - start, 1).to_pylist()[0]
                    return f"{row['id']!r} (sample {row['sample_index']})"
            seen.setdefault(key, []).append((start, start + count))
            position += count
    return "unknown"


def replace_part(out: OutputDir, part: str, keep: pa.Table, sources: PartSources,
                 prefill: dict | None = None) -> None:
    """Rewrite a committed part with only ``keep``'s rows (and their ``sources``) in one atomic step
    (a rename over it, or one PUT; deleted if ``keep`` is empty). It keeps its name and, locally,
    its commit time, so commit order stays, and the engine's ``prefill`` counts of the part it
    replaces (work done by the batches it came from; ``stats.of_table``)."""
    try:
        times = out.store.times(part)
        if not keep.num_rows:
            out.store.delete(part)
            return
    except STORE_ERRORS as e:
        raise out.failed(f"part file {part.rsplit('/', 1)[-1]}", e) from e
    out.commit(keep, sources, St.of_table(keep, prefill), dest=part, times_ns=times)


def archive(out: OutputDir, name: str, table: pa.Table) -> str:
    """Write ``table`` as ``retried/<name>`` (whole, or not at all) → where it went."""
    if out.store.local:
        (out.store.root / RETRIED_DIR).mkdir(exist_ok=True)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    dest = out.store.path(RETRIED_DIR, name)
    try:
        out.store.put(dest, sink.getvalue().to_pybytes())
    except STORE_ERRORS as e:
        raise out.failed(f"{RETRIED_DIR}/{name}", e) from e
    return dest
