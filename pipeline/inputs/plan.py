"""Input preflight: resolve Parquet paths and check files and columns before any model loads.

JSONL inputs reach this as Parquet too: ``staging.py`` converts them first, and ``resolve_files``
also lists them (by suffix) for it.

Runs on the driver, so it reads **footers only** (in parallel threads): file listing, schemas, row
counts and row-group sizes. Its time and memory grow with the number of files, never with rows. A
missing column, a column of the wrong type, schemas that cannot be unified or an unreadable footer
fail the job at once, naming the file and the field. Row-level checks run where the rows are read
(Ray tasks): ids in ``checks.py`` (before the first commit), everything else in ``source.py``;
``input.verify: full`` runs the full read of every row group as a distributed pass up front
(``checks.py``).

Inputs are local paths or URIs of one filesystem (``pipeline/storage/uris.py``); on an object store a
"directory" is a key prefix, and globs are matched against the listing below their fixed prefix.
"""
from __future__ import annotations

import glob
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.inputs.column_types import plain_type
from pipeline.config import ConfigError, InputConfig, StorageConfig
from pipeline.requests.structured import STAGED_STRUCTURED, STRUCTURED_FIELD
from pipeline.requests.sampling_fields import OVERRIDE_COLUMNS
from pipeline.schema import GENERATED_FIELDS, INTERNAL_PREFIX, OUTPUT_NAMES, PROCESSOR_INPUTS
from pipeline.storage.uris import Location, glob_regex, info, is_remote, list_files, local_path, locate

_GLOB_CHARS = set("*?[")
PARQUET_SUFFIXES = (".parquet",)
# Written by staging.py on rows it could not convert (a malformed JSONL line): consumed, never
# passed through; the preprocessing makes it the row's error.
INPUT_ERROR = "__input_error"
# STAGED_STRUCTURED and STRUCTURED_FIELD are written by staging.py on OpenAI-batch rows (the body's
# constraint and the field it came from, which their errors name) and consumed like INPUT_ERROR.
INTERNAL_INPUTS = (INPUT_ERROR, STAGED_STRUCTURED, STRUCTURED_FIELD)


@dataclass(frozen=True)
class InputPlan:
    """What the pipeline needs to know about its inputs (picklable; shipped to Ray tasks)."""

    files: tuple[str, ...]              # absolute paths (inside ``filesystem``), sorted
    file_rows: tuple[int, ...]          # rows per file, aligned with ``files``
    row_groups: tuple[tuple[int, ...], ...]   # rows per row group, per file
    roots: tuple[str, ...]              # directories searched (and single files named) by input.paths
    schema: pa.Schema                   # unified schema of all files
    num_rows: int
    id_column: str | None               # None: ids derived as "<file name>:<row index>"
    prompt_column: str | None           # None when no file has it
    messages_column: str | None
    override_columns: tuple[str, ...]   # per-row sampling overrides present in the input
    passthrough: tuple[str, ...]        # input columns copied to the output unchanged
    partition_base: str | None = None   # hive partitions (key=value directories) are read below this
    partition_columns: tuple[str, ...] = ()   # their keys: string pass-through columns
    filesystem: pafs.FileSystem | None = None  # None: the local filesystem; else the store of every input
    scheme: str = "file"                # 's3', 'gs', ... for inputs in object storage
    input_error: bool = False           # the inputs carry an INPUT_ERROR column (staged JSONL)

    @property
    def passthrough_fields(self) -> list[pa.Field]:
        """Arrow fields of the pass-through columns (part of the output schema)."""
        return [self.schema.field(name) for name in self.passthrough]


def _walk(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files ending in one of ``suffixes`` under ``directory``, skipping hidden and ``_``-prefixed
    entries (temp files)."""
    found = []
    for d, subdirs, names in os.walk(directory):
        subdirs[:] = [x for x in subdirs if not x.startswith((".", "_"))]
        found += [os.path.join(d, f) for f in names if f.endswith(suffixes) and not f.startswith((".", "_"))]
    return found


def _expand(pattern: str, index: int, suffixes: tuple[str, ...], what: str) -> tuple[list[str], str]:
    """Files matched by one ``input.paths`` entry, and the directory they were searched in. A glob
    or a named file is taken whatever its suffix; a directory is searched for ``suffixes``."""
    where = f"input.paths[{index}] ({pattern!r})"
    if any(c in pattern for c in _GLOB_CHARS):
        files = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        root = pattern
        while any(c in root for c in _GLOB_CHARS):
            root = os.path.dirname(root)
        root = root or "."
    elif os.path.isdir(pattern):
        root, files = pattern, _walk(pattern, suffixes)
    elif os.path.isfile(pattern):
        files, root = [pattern], pattern  # a single file: only the file itself is "the input"
    else:
        raise ConfigError(f"{where}: no such file or directory")
    if not files:
        raise ConfigError(f"{where}: matched no {what} files")
    return [os.path.realpath(f) for f in files], os.path.realpath(root)


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def _expand_remote(loc: Location, where: str, suffixes: tuple[str, ...]) -> tuple[list[str], str]:
    """Like :func:`_expand`, on an object store or other remote filesystem."""
    if any(c in loc.path for c in _GLOB_CHARS):
        parts = loc.path.split("/")
        fixed = next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))
        root = "/".join(parts[:fixed])
        match = glob_regex(loc.path)
        listed = list_files(loc.at(root), where)
        return [f.path for f in listed if match.match(f.path)], root
    found = info(loc, where)
    if found.type == pafs.FileType.File:
        return [loc.path], loc.path
    if found.type == pafs.FileType.NotFound:
        raise ConfigError(f"{where}: no such file or prefix")
    listed = list_files(loc, where)
    return [f.path for f in listed if f.path.endswith(suffixes)
            and not _hidden(f.path[len(loc.path):].lstrip("/"))], loc.path


def resolve_files(cfg: InputConfig, storage: StorageConfig = StorageConfig(),
                  suffixes: tuple[str, ...] = PARQUET_SUFFIXES, what: str = "Parquet"
                  ) -> tuple[list[str], list[str], Location | None]:
    """All input files (deduplicated, sorted), the directories they came from, and their filesystem
    (None: local). Directories and prefixes are searched for files ending in ``suffixes``; ``what``
    names those files in the error for an entry that matches none."""
    files: set[str] = set()
    roots: list[str] = []
    where = [f"input.paths[{i}] ({p!r})" for i, p in enumerate(cfg.paths)]
    locs = [locate(p, storage, w) if is_remote(p) else None for p, w in zip(cfg.paths, where)]
    if len({(loc.scheme, loc.authority) if loc else None for loc in locs}) > 1:
        raise ConfigError(f"input.paths mixes filesystems ({', '.join(cfg.paths)}); put every input in one store")
    for i, (pattern, remote) in enumerate(zip(cfg.paths, locs)):
        if remote is not None:
            found, root = _expand_remote(remote, where[i], suffixes)
            if not found:
                raise ConfigError(f"{where[i]}: matched no {what} files")
        else:
            found, root = _expand(local_path(pattern), i, suffixes, what)
        files.update(found)
        roots.append(root)
    return sorted(files), roots, locs[0]


@dataclass(frozen=True)
class Footer:
    """What preflight keeps of one input file's footer."""

    schema: pa.Schema
    num_rows: int
    row_groups: tuple[int, ...]


def _read_footer(path: str, fs: pafs.FileSystem | None) -> Footer:
    try:
        meta = pq.read_metadata(path, filesystem=fs)
        return Footer(meta.schema.to_arrow_schema(), meta.num_rows,
                      tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"input file {path} is not a readable Parquet file: {e}") from None


def read_footers(files: list[str], fs: pafs.FileSystem | None, threads: int = 32) -> list[Footer]:
    """Every file's footer, read in parallel threads (footer reads are I/O-bound; on an object
    store each is one or two ranged GETs). Bounded by the number of files."""
    if len(files) <= 1:
        return [_read_footer(f, fs) for f in files]
    with ThreadPoolExecutor(max_workers=min(threads, len(files))) as pool:
        return list(pool.map(lambda f: _read_footer(f, fs), files))


def _check_type(name: str, ok, expected: str, schemas: list[pa.Schema], files: list[str]) -> None:
    """Raise naming the first file whose ``name`` column fails ``ok`` (files may disagree)."""
    for schema, path in zip(schemas, files):
        if name in schema.names and not ok(schema.field(name).type):
            raise ConfigError(f"input column {name!r} has type {schema.field(name).type}, expected {expected} "
                              f"(in {path})")


def _check_types(schemas: list[pa.Schema], id_col: str | None, prompt: str | None, messages: str | None,
                 overrides: tuple[str, ...], files: list[str]) -> None:
    """Reject column types the preprocessing cannot read (the row-level checks come later)."""
    is_text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)  # noqa: E731
    if id_col:
        _check_type(id_col, lambda t: is_text(t) or pa.types.is_integer(t), "string or integer", schemas, files)
    if prompt:
        _check_type(prompt, lambda t: is_text(t) or pa.types.is_null(t), "string", schemas, files)
    if messages:
        ok = lambda t: (is_text(t) or pa.types.is_null(t) or pa.types.is_list(t)  # noqa: E731
                        or pa.types.is_large_list(t))
        _check_type(messages, ok, "list of {role, content} or JSON string", schemas, files)
    is_list = lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)  # noqa: E731
    for name in overrides:
        if name == "structured":   # JSON text of {kind: value}, or that as a struct or map
            ok = lambda t: (is_text(t) or pa.types.is_null(t) or pa.types.is_struct(t)  # noqa: E731
                            or pa.types.is_map(t))
            _check_type(name, ok, "JSON text, a struct or a map ({kind: value})", schemas, files)
            continue
        if name == "stop":   # a list of stop strings, or one
            ok = lambda t: (is_text(t) or pa.types.is_null(t)  # noqa: E731
                            or (is_list(t) and (is_text(t.value_type) or pa.types.is_null(t.value_type))))
            _check_type(name, ok, "a list of strings or a string", schemas, files)
            continue
        if name == "logit_bias":   # token id -> bias: a map, an object (a struct by token id), or JSON text
            ok = lambda t: (is_text(t) or pa.types.is_null(t) or pa.types.is_map(t)  # noqa: E731
                            or pa.types.is_struct(t) or is_list(t))
            _check_type(name, ok, "a map of token id -> bias, an object or JSON text", schemas, files)
            continue
        if name == "ignore_eos":
            _check_type(name, lambda t: pa.types.is_boolean(t) or pa.types.is_null(t), "a boolean", schemas, files)
            continue
        ok = lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)  # noqa: E731
        _check_type(name, ok, "a number", schemas, files)
    for internal in INTERNAL_INPUTS:
        _check_type(internal, lambda t: is_text(t) or pa.types.is_null(t), "string", schemas, files)


def _unify(schemas: list[pa.Schema], files: list[str]) -> pa.Schema:
    """One schema for all files (int32 + int64 -> int64, ...); name the field and files if impossible."""
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        merged, first = {}, {}
        for schema, path in zip(schemas, files):
            for field in schema:
                try:
                    merged[field.name] = pa.unify_schemas(
                        [pa.schema([merged.get(field.name, field)]), pa.schema([field])],
                        promote_options="permissive").field(0)
                    first.setdefault(field.name, path)
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    raise ConfigError(f"input column {field.name!r} has type {merged[field.name].type} in "
                                      f"{first[field.name]} but {field.type} in {path}; give it one type "
                                      "in every file") from None
        raise ConfigError(f"input files have incompatible schemas: {e}") from None


def _id_column(cfg: InputConfig, schemas: list[pa.Schema], files: list[str]) -> str | None:
    has = [cfg.id_column in s.names for s in schemas]
    if all(has):
        return cfg.id_column
    if any(has):
        missing = [f for f, h in zip(files, has) if not h]
        raise ConfigError(f"id column {cfg.id_column!r} (input.id_column) is missing from {len(missing)} "
                          f"input file(s), e.g. {missing[0]}; give every file ids or none")
    names = Counter(os.path.basename(f) for f in files)
    twins = [n for n, c in names.items() if c > 1]
    if twins:
        raise ConfigError(f"no id column {cfg.id_column!r} (input.id_column) and two input files are named "
                          f"{twins[0]!r}: derived ids '<file name>:<row index>' would collide")
    return None


def _partitions(files: list[str], roots: list[str], schema: pa.Schema) -> tuple[str | None, dict[str, str]]:
    """Hive partition keys of the files' paths below the inputs' common directory, as Ray's
    reader will parse them (its own parser) → (that directory, {key: first file having it})."""
    named = set(files)   # a root that is one of the files is a single named file
    base = os.path.commonpath([os.path.dirname(r) if r in named else r for r in roots])
    if not any("=" in os.path.relpath(os.path.dirname(f), base) for f in files):
        return None, {}                               # no key=value directory: skip importing Ray
    from ray.data.datasource.partitioning import Partitioning, PathPartitionParser

    parse = PathPartitionParser(Partitioning("hive", base_dir=base))
    keys: dict[str, str] = {}
    for path in files:
        for key in parse(path):
            keys.setdefault(key, path)
    clash = [k for k in keys if k in schema.names]
    if clash:
        raise ConfigError(f"input column {clash[0]!r} is also a hive partition key in the path of {keys[clash[0]]}; "
                          "rename the column or the directory")
    return (base if keys else None), keys


def inspect_inputs(cfg: InputConfig, storage: StorageConfig = StorageConfig()) -> InputPlan:
    """Resolve and check the inputs; raise :class:`ConfigError` naming the file or field."""
    files, roots, remote = resolve_files(cfg, storage)
    fs = remote.fs if remote else None
    footers = read_footers(files, fs)
    schemas, counts = [f.schema for f in footers], [f.num_rows for f in footers]
    schema = _unify(list(schemas), files)
    base, partitions = _partitions(files, roots, schema)
    schema = pa.schema([f.with_type(plain_type(f.type)) for f in schema]
                       + [pa.field(k, pa.string()) for k in partitions])
    id_col = _id_column(cfg, list(schemas), files)
    prompt = cfg.prompt_column if cfg.prompt_column in schema.names else None
    messages = cfg.messages_column if cfg.messages_column in schema.names else None
    if prompt is None and messages is None:
        raise ConfigError(f"no input file has the prompt column {cfg.prompt_column!r} (input.prompt_column) "
                          f"or the messages column {cfg.messages_column!r} (input.messages_column); "
                          f"columns are {schema.names}")
    overrides = tuple(c for c in OVERRIDE_COLUMNS if c in schema.names)
    input_error = INPUT_ERROR in schema.names
    consumed = {id_col, prompt, messages, *overrides, *(c for c in INTERNAL_INPUTS if c in schema.names)} - {None}
    passthrough = tuple(n for n in schema.names if n not in consumed)
    reserved = {*OUTPUT_NAMES, *PROCESSOR_INPUTS, *(f.name for f in GENERATED_FIELDS)}
    clash = [n for n in passthrough if n in reserved or n.startswith(INTERNAL_PREFIX)]
    if clash:
        raise ConfigError(f"input column {clash[0]!r} clashes with a column the job writes or uses; "
                          f"rename it (or set input.id_column if it is the id)")
    _check_types(list(schemas), id_col, prompt, messages, overrides, files)
    return InputPlan(files=tuple(files), file_rows=tuple(counts), row_groups=tuple(f.row_groups for f in footers),
                     roots=tuple(roots), schema=schema, num_rows=sum(counts),
                     id_column=id_col, prompt_column=prompt, messages_column=messages,
                     override_columns=overrides, passthrough=passthrough, partition_base=base,
                     partition_columns=tuple(partitions), filesystem=fs,
                     scheme=remote.scheme if remote else "file", input_error=input_error)
