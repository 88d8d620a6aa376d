"""A staged file's source, for errors about its rows in the user's terms: the source file, its
line numbers, and the id key as the user wrote it (``custom_id`` for OpenAI batch files).

Staging (``staging.py``) writes one row per non-blank source line, in order, and records the source
in the staged file's footer under :data:`STAGED_KEY`; the distributed id checks (``checks.py``)
read staged files like any Parquet input and call here only on their error path.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.inputs.json_lines import iter_lines, open_stream
from pipeline.storage.uris import STORE_ERRORS

STAGED_KEY = "orthrus.staged"     # footer key: the record of the source a staged file was made from

def staged_record(path: str, fs: pafs.FileSystem | None) -> dict | None:
    """The record in a staged file's footer (its source, format ...), or None for any other file."""
    try:
        meta = pq.read_metadata(path, filesystem=fs).metadata or {}
        return json.loads(meta[STAGED_KEY.encode()]) if STAGED_KEY.encode() in meta else None
    except (*STORE_ERRORS, ValueError, KeyError):
        return None


def source_lines(record: dict, rows: list[int]) -> list[int] | None:
    """The 1-based line numbers in the source of staged ``rows`` (a staged file holds one row per
    non-blank line, in order); None when the source cannot be read again (only for error messages:
    one pass over the source, on the error path only)."""
    wanted, found = sorted(set(rows)), {}
    try:
        with open_stream(record["source"], None) as stream:
            for row, (number, _) in enumerate(iter_lines(stream)):
                if row in wanted:
                    found[row] = number
                    if len(found) == len(wanted):
                        break
    except (*STORE_ERRORS, KeyError):
        return None
    return [found[r] for r in rows] if len(found) == len(wanted) else None


def duplicate_in_source(path: str, fs: pafs.FileSystem | None, ids: pa.ChunkedArray, dup: str, count: int) -> str | None:
    """A duplicate id within one staged file, named as the user wrote it: ``custom_id`` (OpenAI
    batch) or the id key, the source file and the two lines; None for a file that is not staged."""
    record = staged_record(path, fs)
    if record is None:
        return None
    rows = np.flatnonzero(pc.equal(ids, dup).to_numpy(zero_copy_only=False))[:2].tolist()
    lines = source_lines(record, rows)
    where = f"lines {lines[0]} and {lines[1]}" if lines else f"rows {rows[0]} and {rows[1]}"
    key = "custom_id" if record.get("format") == "openai_batch" else f"{record.get('id_column')!r} (input.id_column)"
    more = f" ({count} duplicate ids in all)" if count > 1 else ""
    return (f"{key} {dup!r} appears twice in {record['source']}: {where}{more}; ids must be unique "
            "(they key exactly-once output and resume)")


def duplicate_across_sources(paths: list[str], fs: pafs.FileSystem | None, column: str, dup: str,
                             count: int) -> str | None:
    """A duplicate id in two staged files, named as the user wrote it: the key, both source files
    and the line in each; None unless both files are staged."""
    records = [staged_record(p, fs) for p in paths[:2]]
    if len(records) < 2 or None in records:
        return None
    places = []
    for path, record in zip(paths, records):
        ids = pq.read_table(path, columns=[column], filesystem=fs)[column]
        row = int(np.flatnonzero(pc.equal(ids, dup).to_numpy(zero_copy_only=False))[0])
        lines = source_lines(record, [row])
        places.append(f"{record['source']} line {lines[0]}" if lines else f"{record['source']} row {row}")
    key = "custom_id" if records[0].get("format") == "openai_batch" else f"{records[0].get('id_column')!r} (input.id_column)"
    more = f" ({count} duplicate ids in all)" if count > 1 else ""
    return f"{key} {dup!r} appears in {places[0]} and in {places[1]}{more}; ids must be unique (they key " \
           "exactly-once output and resume)"
