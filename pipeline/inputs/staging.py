"""Staging: JSONL and OpenAI-batch inputs converted once into Parquet under ``<output>/_staged/``.

The job's input machinery is Parquet's (footers, one read task per row group, resume by (file,
row) coordinates, the distributed id checks), so JSON Lines inputs join it instead of growing a
second one: before any model loads,

1. :func:`input_format` settles the format (``input.format``, or by file extension for 'auto');
2. :func:`sniff_sources` (driver) lists the files and reads only the first line of each, so a
   Parquet file, a CSV, a JSON array document or a gzip file given as JSONL fails at once, naming
   the file (a first line that is a broken record is only that line's error row);
3. :func:`stage` converts each source in its own task (a Ray task when Ray is running) into
   ``_staged/<source name>-<hash of its path>.parquet``, written atomically, and returns the input
   config that points the Parquet machinery at the staged files.

A staged file's footer records its source's path, size and modification time (what the source's
filesystem reports) and how it was converted; a later :func:`stage` with the same record reuses it,
so a resumed job neither converts again nor shifts any (file, row) coordinate it committed. A
changed source is converted again (its rows are then new rows to resume).
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.config import ConfigError, InputConfig, StorageConfig
from pipeline.output.directory import STAGED_DIR, OutputDir
from pipeline.inputs.plan import PARQUET_SUFFIXES, resolve_files
from pipeline.inputs.json_lines import JSON_SUFFIXES, Tally, jsonl_tables, open_stream
from pipeline.inputs.openai_batch import openai_tables
from pipeline.inputs.staged_source import STAGED_KEY
from pipeline.storage.uris import STORE_ERRORS
from pipeline.tasks import map_tasks

_VERSION = 3                      # of the conversion rules (2: min_tokens, 3: max_thinking_tokens); another converts again
_SNIFF_BLOCK, _SNIFF_LIMIT = 1 << 20, 8 << 20
_MAGIC = {b"PAR1": "it looks like a Parquet file", b"\x1f\x8b": "it looks gzip-compressed: name it .gz",
          b"\x28\xb5\x2f\xfd": "it looks zstd-compressed: name it .zst"}
_T = TypeVar("_T")


@dataclass(frozen=True)
class JsonSources:
    """The JSON Lines inputs, as preflight found them (picklable)."""

    format: str                          # "jsonl" | "openai_batch"
    files: tuple[str, ...]               # absolute paths in ``filesystem``, sorted
    roots: tuple[str, ...]               # directories searched (and single files named) by input.paths
    filesystem: pafs.FileSystem | None   # None: the local filesystem
    scheme: str                          # 's3', 'gs', ... or 'file'


def _threaded(fn: Callable[..., _T], items: list, threads: int = 32) -> list[_T]:
    """``fn`` over ``items`` in threads (each call is a few small reads: I/O-bound)."""
    if len(items) <= 1:
        return [fn(*i) for i in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(lambda i: fn(*i), items))


# -- the format ------------------------------------------------------------------------------------

def input_format(cfg: InputConfig, storage: StorageConfig) -> str:
    """'parquet', 'jsonl' or 'openai_batch': ``input.format``, or for 'auto' what the extensions of
    the input files say (an OpenAI batch file must be declared: its extension is .jsonl). Lists
    the inputs once (bounded by files)."""
    if cfg.format != "auto":
        return cfg.format
    files, _, _ = resolve_files(cfg, storage, PARQUET_SUFFIXES + JSON_SUFFIXES, "Parquet or JSONL")
    first: dict[str, str] = {}
    for path in files:
        fmt = "parquet" if path.endswith(PARQUET_SUFFIXES) else "jsonl" if path.endswith(JSON_SUFFIXES) else None
        if fmt is None:
            raise ConfigError(f"input file {path}: cannot tell its format from its name (.parquet; .jsonl, .ndjson "
                              "or .json, optionally .gz or .zst); set input.format")
        first.setdefault(fmt, path)
    if len(first) > 1:
        raise ConfigError(f"input.paths mixes formats: {first['parquet']} is Parquet but {first['jsonl']} is JSONL; "
                          "give the job one format (input.format)")
    return next(iter(first))


# -- preflight: the first line of each file ---------------------------------------------------------

def _first_line(path: str, fs: pafs.FileSystem | None) -> tuple[bytes, bool]:
    """The first non-blank line (b'' for an empty file), and whether it was cut at the sniff limit."""
    buf = b""
    with open_stream(path, fs) as stream:
        while len(buf) < _SNIFF_LIMIT:
            block = stream.read(_SNIFF_BLOCK)
            buf = (buf + block).lstrip()          # blank lines before the first one are skipped
            end = buf.find(b"\n")
            if end >= 0 or not block:
                return buf[:end] if end >= 0 else buf, False
    return buf, True


def _not_json_lines(line: bytes, cut: bool) -> str | None:
    """Why a file whose first line is ``line`` is clearly not JSON Lines, or None. Judged by what
    the line is, not by whether it parses: a line starting with '{' is a JSON Lines record even if
    it is broken (invalid UTF-8, nesting deeper than the parser allows): then it is an error row
    naming its line and the cause, like any other line."""
    magic = next((what for magic, what in _MAGIC.items() if line.startswith(magic)), None)
    if magic:
        return magic
    if not line or line.startswith(b"{"):
        return None
    if line.startswith(b"["):
        return "it looks like a JSON array document: JSON Lines holds one object per line"
    if not cut and b"," in line and not line.lstrip().startswith((b'"', b"[")):
        return "it looks like CSV"
    return "its first line does not start with '{'"


def _sniff_one(path: str, fs: pafs.FileSystem | None, fmt: str, cfg: InputConfig) -> None:
    """Raise :class:`ConfigError` naming ``path`` if it is clearly not ``fmt``."""
    try:
        line, cut = _first_line(path, fs)
    except STORE_ERRORS as e:
        raise ConfigError(f"input file {path} cannot be read: {e}") from None
    line = line.removeprefix(b"\xef\xbb\xbf")
    declared = f"(input.format: {fmt})"
    why = _not_json_lines(line, cut)
    if why:
        raise ConfigError(f"input file {path} is not JSON Lines {declared}: {why}; it starts {line[:40]!r}")
    try:
        obj = json.loads(line.decode("utf-8")) if line and not cut else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        obj = None                                # broken: the line's own error row says why
    if not isinstance(obj, dict):
        return
    if fmt == "openai_batch":
        for key, typ, what in (("custom_id", str, "string"), ("body", dict, "object")):
            if not isinstance(obj.get(key), typ):
                raise ConfigError(f"input file {path} is not an OpenAI batch file {declared}: its first line has no "
                                  f"{what} {key!r}")
    elif {"custom_id", "body"} <= obj.keys() and not {cfg.prompt_column, cfg.messages_column} & obj.keys():
        raise ConfigError(f"input file {path} holds OpenAI batch requests (custom_id, body); set input.format: "
                          "openai_batch")


def sniff_sources(cfg: InputConfig, storage: StorageConfig, fmt: str) -> JsonSources:
    """List the JSON Lines inputs and check the first line of each (driver; bounded by files: one
    open and a read of at most a few MiB per file, in threads, whatever the files' sizes)."""
    if fmt not in ("jsonl", "openai_batch"):
        raise ValueError(f"sniff_sources: not a JSON Lines format: {fmt!r}")
    files, roots, remote = resolve_files(cfg, storage, JSON_SUFFIXES, "JSONL")
    fs = remote.fs if remote else None
    _threaded(_sniff_one, [(f, fs, fmt, cfg) for f in files])
    return JsonSources(fmt, tuple(files), tuple(roots), fs, remote.scheme if remote else "file")


# -- conversion (one task per file) -----------------------------------------------------------------

def _identity(path: str, fs: pafs.FileSystem | None) -> dict:
    """What tells a changed source from the one converted: its size and modification time."""
    try:
        info = (fs or pafs.LocalFileSystem()).get_file_info(path)
    except STORE_ERRORS as e:
        raise ConfigError(f"input file {path} cannot be read: {e}") from None
    if info.type != pafs.FileType.File:
        raise ConfigError(f"input file {path} is gone (it was listed at start)")
    return {"source": path, "size": info.size, "mtime_ns": info.mtime_ns}


@dataclass(frozen=True)
class _How:
    """How every source is converted (what a task needs besides its file; small, so per-task
    arguments do not grow with the number of files)."""

    format: str
    filesystem: pafs.FileSystem | None
    id_column: str | None                 # jsonl: input.id_column; openai_batch: None (custom_id)

    def wanted(self, path: str) -> dict:
        """The record a staged file of ``path`` must carry to be reused (minus what conversion counts)."""
        return {**_identity(path, self.filesystem), "format": self.format, "id_column": self.id_column,
                "version": _VERSION}


def _reusable(how: _How, out: OutputDir, path: str, dest: str) -> dict | None:
    """The record of ``dest`` if it was staged from ``path`` as it is now, else None (convert it)."""
    wanted = how.wanted(path)
    try:
        meta = pq.read_metadata(dest, filesystem=out.fs).metadata or {}
        record = json.loads(meta.get(STAGED_KEY.encode(), b"{}"))
    except (*STORE_ERRORS, ValueError):          # absent, half-written by hand, or not ours
        return None
    same = wanted["mtime_ns"] is not None and all(record.get(k) == v for k, v in wanted.items())
    return record if same else None


@contextmanager
def _writing(out: OutputDir, dest: str) -> Iterator[None]:
    """A failed write into the output directory → :class:`OutputWriteError` (not the input's fault)."""
    try:
        yield
    except STORE_ERRORS as e:
        raise out.failed(f"{STAGED_DIR}/{posixpath.basename(dest)}", e) from e


def _write(out: OutputDir, dest: str, schema: pa.Schema, tables: Iterator[pa.Table], record: dict,
           tally: Tally) -> None:
    """Stream ``tables`` into ``dest`` (one row group each), whole or not at all; the footer gets
    ``record`` and what the conversion counted."""
    stream = tmp = None
    try:
        with _writing(out, dest):
            stream, tmp = out.store.sink(dest)
            writer = pq.ParquetWriter(stream, schema)
        for table in tables:                      # a read error of the source propagates as itself
            with _writing(out, dest):
                writer.write_table(table, row_group_size=max(1, table.num_rows))
        with _writing(out, dest):
            full = {**record, "rows": tally.rows, "synthetic": tally.synthetic}
            writer.add_key_value_metadata({STAGED_KEY: json.dumps(full)})
            writer.close()
            out.store.finish(stream, tmp, dest)
    except BaseException:
        out.store.abort(stream, tmp)
        raise


def convert(how: _How, out: OutputDir, path: str, dest: str) -> dict:
    """Task: stage one source → the record now in its footer. The source is looked at before it is
    read, so a change made while converting shows as a change next time."""
    record, tally = how.wanted(path), Tally()
    try:
        schema, tables = (jsonl_tables(path, how.filesystem, how.id_column, tally) if how.format == "jsonl"
                          else openai_tables(path, how.filesystem, tally))
        _write(out, dest, schema, tables, record, tally)
    except STORE_ERRORS as e:                     # reading: unreadable, or a corrupt compressed stream
        raise ConfigError(f"input file {path} cannot be read: {type(e).__name__}: {e}") from None
    return {**record, "rows": tally.rows, "synthetic": tally.synthetic}


# -- the driver --------------------------------------------------------------------------------------

def staged_path(out: OutputDir, path: str) -> str:
    """``<output>/_staged/<name>-<8 hex of a hash of the path>.parquet``: the name for reading, with
    characters other than letters, digits and ``._-`` made ``_`` (a ``*`` or ``[`` would make the
    staged path a glob in input.paths); the hash keeps two sources of one name apart."""
    digest = hashlib.sha256(path.encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(path))
    return out.store.path(STAGED_DIR, f"{name}-{digest}.parquet")


def _check_made_up_ids(files: tuple[str, ...], records: list[dict]) -> None:
    """Two sources of one name whose rows got ids '<file name>:<line>' could give two rows one id."""
    seen: dict[str, str] = {}
    for path, record in zip(files, records):
        if record.get("synthetic"):
            name = posixpath.basename(path)
            if name in seen:
                raise ConfigError(f"input files {seen[name]} and {path} are both named {name!r} and rows of both "
                                  f"need ids made up as '<file name>:<line>', which would collide; rename one "
                                  "(or give every row an id)")
            seen[name] = path


def stage(sources: JsonSources, cfg: InputConfig, out: OutputDir) -> InputConfig:
    """Convert what is not staged yet, one task per file, and return ``cfg`` pointing at the staged
    Parquet files. The driver's work is bounded by files: a stat of each source and a footer read
    of each staged file (threads), then small records back from the tasks."""
    dests = [staged_path(out, p) for p in sources.files]
    if out.store.local:                           # object stores need no directories
        with _writing(out, out.store.path(STAGED_DIR)):
            for folder in (out.store.root / STAGED_DIR, out.tmp):
                folder.mkdir(parents=True, exist_ok=True)
    how = _How(sources.format, sources.filesystem, cfg.id_column if sources.format == "jsonl" else None)
    records = _threaded(lambda p, d: _reusable(how, out, p, d), list(zip(sources.files, dests)))
    todo = [i for i, r in enumerate(records) if r is None]
    done = map_tasks(convert, [(how, out, sources.files[i], dests[i]) for i in todo])
    for i, record in zip(todo, done):
        records[i] = record
    _check_made_up_ids(sources.files, records)
    paths = dests if out.store.local else [out.store.loc.at(d).uri for d in dests]
    update: dict = {"paths": paths, "format": "parquet"}
    if sources.format == "openai_batch":
        update.update(id_column="id", prompt_column="prompt", messages_column="messages")
    return cfg.model_copy(update=update)

