"""Pass-through columns: which Arrow types the job carries from input to output, and how.

A pass-through column travels Ray's Parquet reader, the preprocessing task (``take`` of the kept
rows, a cast to the inputs' unified type), Ray's object store, the driver's cast to the output
schema and the Parquet writer. Some legal types break one of those steps mid-run, so preflight
settles every column up front (``check_group``), naming the column and the file:

- view types (``string_view``, ``binary_view``, ``list_view`` ..., also nested) have no ``take``
  kernel and some casts of them are broken; they are carried as their plain equivalents
  (``string``, ``binary``, ``list`` ...), a lossless conversion (``plain_type`` / ``convert``);
- a column whose type differs between files is cast to the unified type by Ray's reader, which
  fails on a value that does not fit exactly (an int64 beyond 2**53 in a column that another file
  holds as double): such a file is refused, with the value;
- anything else is proved by a round trip of each file's first rows through the conversion and
  the Parquet writer and reader.
"""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError

_ROUND_TRIP_ROWS = 16


def _is_view(t: pa.DataType) -> bool:
    return (pa.types.is_string_view(t) or pa.types.is_binary_view(t) or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t))


def plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` with every view type (at any depth) replaced by its plain equivalent."""
    if pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_list_view(t) or pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_large_list_view(t) or pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(plain_type(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(plain_type(t.key_type)), t.item_field.with_type(plain_type(t.item_type)))
    return t


def convert(col: pa.ChunkedArray, typ: pa.DataType) -> pa.ChunkedArray:
    """``col`` as ``typ`` (the unified, view-free type of its column)."""
    if col.type == typ:
        return col
    if plain_type(col.type) != col.type:         # views: through Python values (lossless; some
        if pa.types.is_string_view(col.type) or pa.types.is_binary_view(col.type):   # view casts are broken)
            return col.cast(typ)
        return pa.chunked_array([pa.array(col.to_pylist(), typ)], typ)
    try:
        return col.cast(typ)
    except pa.ArrowInvalid:   # preflight proved the values fit; this keeps a late surprise a cast
        return col.cast(typ, safe=False)


def check_group(group: pa.Table, fields: list[pa.Field], path: str, first: bool) -> None:
    """Raise :class:`ConfigError` if a pass-through column of this row group cannot be carried."""
    for field in fields:
        if field.name not in group.column_names:
            continue
        col = group[field.name]
        if col.type != field.type and plain_type(col.type) == col.type:
            try:
                col.cast(field.type)    # what Ray's reader does to a file whose type differs
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ConfigError(f"input column {field.name!r} is {col.type} in {path} but {field.type} in another "
                                  f"input file, and a value here does not convert exactly ({e}); give the column "
                                  "one type in every file") from None
        if first:
            _round_trip(field, col.slice(0, _ROUND_TRIP_ROWS), path)


def _round_trip(field: pa.Field, col: pa.ChunkedArray, path: str) -> None:
    try:
        table = pa.table({field.name: convert(col, field.type)}, schema=pa.schema([field]))
        buf = io.BytesIO()
        pq.write_table(table, buf)
        back = pq.read_table(io.BytesIO(buf.getvalue()))
        if not back.equals(table):
            raise ValueError("the values read back differ from the values written")
    except (pa.ArrowException, ValueError, TypeError, OverflowError) as e:
        raise ConfigError(f"input column {field.name!r} (type {col.type} in {path}) cannot be carried to the "
                          f"output: {type(e).__name__}: {e}. Cast it in the input or drop it") from None
