"""Reading JSON Lines: decompression, line splitting, per-line parsing, and a JSONL file's objects
as Arrow tables of one schema.

Runs inside the staging tasks (``staging.py``), one file per task; memory is bounded by one chunk
of :data:`ROW_GROUP` lines. A line that cannot become a row (invalid UTF-8 or JSON, not an object,
a value Arrow cannot hold) is not an exception: it becomes an error row, its message naming the
1-based physical line, so one bad line costs one row, never the file.

The schema of a file comes from a first pass over it (each key's type, as ``pa.array`` infers it,
unified over the chunks); the second pass builds the row groups in that schema. Two passes keep
memory at one chunk whatever the file's size, at the price of reading it twice. A key whose values
cannot share one type (an int in one line, an object in another) becomes a string column holding
each value's JSON text, so every cell of it decodes the same way; so does the ``structured`` key
whenever it holds objects (a row's constraint must arrive exactly as written).
"""
from __future__ import annotations

import json
import posixpath
import re
import sys
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.inputs.plan import INPUT_ERROR
from pipeline.requests.request_keys import JOB_COLUMNS, unsupported
from pipeline.requests.structured import STRUCTURED

ROW_GROUP = 8192                           # rows per chunk, and per row group of a staged file
COMPRESSION = {".gz": "gzip", ".zst": "zstd"}
JSON_SUFFIXES = tuple(s + c for s in (".jsonl", ".ndjson", ".json") for c in ("", *COMPRESSION))
_BLOCK = 1 << 20
_CONVERSION_ERRORS = (pa.ArrowException, ValueError, TypeError, OverflowError)
# A lone surrogate can only come from a \uD800-\uDFFF escape (strict UTF-8 decoding refuses encoded
# ones): lines without such an escape (nearly all) skip the walk over their strings.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

Parsed = tuple[int, "dict | None", "str | None"]   # (line number, the object or None, the line's error)


@dataclass
class Tally:
    """What a conversion saw, filled in as its tables are consumed."""

    rows: int = 0
    synthetic: bool = False    # some row's id was made up as '<file name>:<line>'


def open_stream(path: str, fs: pafs.FileSystem | None) -> pa.NativeFile:
    """The file's bytes, decompressed by its suffix (``.gz``, ``.zst``)."""
    raw = (fs or pafs.LocalFileSystem()).open_input_stream(path, compression=None)
    codec = COMPRESSION.get(posixpath.splitext(path)[1])
    return pa.CompressedInputStream(raw, codec) if codec else raw


def iter_lines(stream: pa.NativeFile) -> Iterator[tuple[int, bytes]]:
    """(1-based physical line number, bytes without the newline) of every non-blank line. A line
    longer than a block is gathered piecewise (no quadratic concatenation)."""
    number, pending = 0, []
    while block := stream.read(_BLOCK):
        pieces = block.split(b"\n")
        if len(pieces) == 1:
            pending.append(block)
            continue
        pieces[0] = b"".join([*pending, pieces[0]])
        pending = [pieces.pop()]
        for line in pieces:
            number += 1
            if line and not line.isspace():
                yield number, line
    tail = b"".join(pending)
    if tail and not tail.isspace():
        yield number + 1, tail


def kind(value: object) -> str:
    """A JSON value's kind, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


class _IntRange(Exception):
    """An integer literal beyond 64 bits (Arrow's widest integer)."""


def _int64(text: str) -> int:
    value = int(text)
    if not -2 ** 63 <= value < 2 ** 63:
        raise _IntRange
    return value


_DECODER = json.JSONDecoder(parse_int=_int64)    # built once: json.loads(s, **kw) builds one per call


def _has_lone_surrogate(value: object) -> bool:
    """Whether a string in ``value`` (keys too) holds a lone surrogate, which UTF-8 (and so Arrow)
    cannot encode. Iterative, so deep nesting cannot overflow the stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():       # O(1) in CPython; only non-ASCII text can hold a surrogate
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_line(number: int, raw: bytes, name: str) -> tuple[dict | None, str | None]:
    """One line → (its object, None) or (None, why it is not a row, naming the line)."""
    where = f"line {number} of {name}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})"
    if number == 1:
        text = text.removeprefix("\ufeff")        # a byte-order mark some editors write
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        return None, f"{where}: not valid JSON: {e.msg} (column {e.colno})"
    except _IntRange:
        return None, f"{where}: an integer does not fit in 64 bits"
    except RecursionError:
        return None, f"{where}: nested deeper than the JSON parser allows (about {sys.getrecursionlimit()} levels)"
    except ValueError as e:                       # an over-long integer
        return None, f"{where}: not valid JSON: {e}"
    if not isinstance(obj, dict):
        return None, f"{where}: not a JSON object but {kind(obj)}"
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(obj):
        return None, f"{where}: a string holds a lone surrogate escape (not valid Unicode)"
    return obj, None


def parsed_chunks(path: str, fs: pafs.FileSystem | None, name: str, size: int = ROW_GROUP) -> Iterator[list[Parsed]]:
    """The file's non-blank lines, parsed, in chunks of ``size``. Read errors (a corrupt
    compressed stream) propagate: they are the file's, not a line's."""
    with open_stream(path, fs) as stream:
        chunk: list[Parsed] = []
        for number, raw in iter_lines(stream):
            chunk.append((number, *parse_line(number, raw, name)))
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _columns(objs: list[dict | None], skip: tuple[str, ...]) -> dict[str, list]:
    """Key → its value in each object (None where absent), keys in first-seen order."""
    cols: dict[str, list] = {}
    for i, obj in enumerate(objs):
        for key, value in (obj or {}).items():
            col = cols.get(key)
            if col is None:
                col = cols[key] = [None] * len(objs)
            col[i] = value
    for key in skip:
        cols.pop(key, None)
    return cols


def _storable(t: pa.DataType) -> bool:
    """Whether Parquet can store ``t`` (it has no struct without fields, which ``{}`` infers to)."""
    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(_storable(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _storable(t.value_type)
    return True


def _unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both fit in (int64 + double -> double, structs merge their fields), or None."""
    try:
        return pa.unify_schemas([pa.schema([pa.field("x", a)]), pa.schema([pa.field("x", b)])],
                                promote_options="permissive").field(0).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None


def infer(chunks: Iterator[list[Parsed]], id_column: str) -> tuple[dict[str, pa.DataType | None], bool]:
    """First pass: each key's type over the file (None: JSON text), and whether any line has an id."""
    types: dict[str, pa.DataType | None] = {}
    has_id = False
    for chunk in chunks:
        objs = [obj for _, obj, _ in chunk if obj is not None]
        has_id = has_id or any(obj.get(id_column) is not None for obj in objs)
        for key, values in _columns(objs, (id_column, INPUT_ERROR)).items():
            if key in types and types[key] is None:
                continue                          # already JSON text: nothing can change that
            try:
                found = pa.array(values).type
            except _CONVERSION_ERRORS:            # values of this chunk cannot share a type
                found = None
            if found is not None and key in types:
                found = _unify(types[key], found)
            if key == STRUCTURED and found is not None and not pa.types.is_string(found):
                found = None    # JSON text, exactly: a struct would merge all rows' schemas, nulls filled in
            types[key] = found if found is not None and _storable(found) else None
    return types, has_id


def _row_id(obj: dict | None, number: int, id_column: str, has_id: bool, name: str) -> tuple[str, bool, str | None]:
    """(the row's id, whether it is made up, the row's error or None). A malformed line, and every
    line of a file without ids, gets '<file name>:<line>'; so does a line lacking the id that other
    lines have, as an error row."""
    value = None if obj is None else obj.get(id_column)
    made_up, where = f"{name}:{number}", f"line {number} of {name}"
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        row_id, synthetic, error = str(value), False, None
    elif value is None:
        missing = obj is not None and has_id
        row_id, synthetic = made_up, True
        error = f"{where}: no {id_column!r} (input.id_column), which other lines have" if missing else None
    else:
        row_id, synthetic = made_up, True
        error = f"{where}: {id_column!r} (input.id_column) must be a string or an integer, not {kind(value)}"
    if error is None and obj is not None and INPUT_ERROR in obj:
        error = f"{where}: the key {INPUT_ERROR!r} is reserved"
    if error is None and obj is not None:      # request options we do not implement (request_keys.py)
        error = next((f"{where}: {k}: {why}" for k in JOB_COLUMNS if (why := unsupported(k, obj.get(k)))), None)
    return row_id, synthetic, error


def _arrays(objs: list[dict | None], types: dict[str, pa.DataType | None], skip: tuple[str, ...]
            ) -> tuple[dict[str, pa.Array], dict[int, str]]:
    """Each key's column in its file-wide type → (arrays, {row: why a value does not fit})."""
    cols, arrays, bad = _columns(objs, skip), {}, {}
    for key, typ in types.items():
        values = cols.get(key)
        if values is None:
            arrays[key] = pa.nulls(len(objs), typ or pa.string())
        elif typ is None:
            arrays[key] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values],
                                   pa.string())
        else:
            try:
                arrays[key] = pa.array(values, type=typ)
            except _CONVERSION_ERRORS:            # e.g. an int beyond 2**53 where other chunks made it double
                for i, v in enumerate(values):
                    try:
                        pa.array([v], type=typ)
                    except _CONVERSION_ERRORS as e:
                        bad.setdefault(i, f"the value of {key!r} does not fit its column's type {typ}: {e}")
    return arrays, bad


def jsonl_table(chunk: list[Parsed], schema: pa.Schema, types: dict[str, pa.DataType | None], id_column: str,
                has_id: bool, name: str, tally: Tally) -> pa.Table:
    """Second pass: one chunk as a table of ``schema``; error rows hold only their id and error."""
    ids, errors, objs = [], [], []
    for number, obj, error in chunk:
        row_id, made_up, id_error = _row_id(obj, number, id_column, has_id, name)
        tally.synthetic |= made_up
        ids.append(row_id)
        errors.append(error or id_error)
        objs.append(None if error or id_error else obj)
    arrays, bad = _arrays(objs, types, (id_column, INPUT_ERROR))
    if bad:          # malformed after all: error rows with made-up ids, as parse_line's; the rest builds now
        for i, why in bad.items():
            number = chunk[i][0]
            ids[i], errors[i], objs[i] = f"{name}:{number}", f"line {number} of {name}: {why}", None
        tally.synthetic = True
        arrays, bad = _arrays(objs, types, (id_column, INPUT_ERROR))
        if bad:   # cannot happen: each value that did not fit alone is now null
            raise RuntimeError(f"{name}: staging could not place {bad}")
    tally.rows += len(chunk)
    return pa.table({id_column: pa.array(ids, pa.string()), **arrays,
                     INPUT_ERROR: pa.array(errors, pa.string())}, schema=schema)


def jsonl_tables(path: str, fs: pafs.FileSystem | None, id_column: str, tally: Tally
                 ) -> tuple[pa.Schema, Iterator[pa.Table]]:
    """A JSONL file as (its schema, its tables of up to :data:`ROW_GROUP` rows): the id column
    first (always text), then the keys in first-seen order, then :data:`INPUT_ERROR`."""
    name = posixpath.basename(path)
    types, has_id = infer(parsed_chunks(path, fs, name), id_column)
    schema = pa.schema([pa.field(id_column, pa.string()), *(pa.field(k, t or pa.string()) for k, t in types.items()),
                        pa.field(INPUT_ERROR, pa.string())])
    tables = (jsonl_table(chunk, schema, types, id_column, has_id, name, tally)
              for chunk in parsed_chunks(path, fs, name))
    return schema, tables
