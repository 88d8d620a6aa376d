"""Repairs of an existing output directory, run with the lease held, before a resumed run.

- ``dedupe``: keep the first committed copy of each (id, sample_index) (``--dedupe``);
- ``retry_errors``: take the rows committed as errors out of ``data/`` (kept in ``retried/``), so
  the resumed run generates them again (``--retry-errors``).

Both rewrite a part without some of its rows in an order that never shows a key twice in
``data/``: the old part leaves ``data/`` (renamed into ``_tmp/``), then the rewritten part is
committed as usual, then the old one is deleted. A crash in between leaves the part's other rows
absent, never doubled; ``_tmp/`` is wiped at the next start and the resumed run generates those
rows again (seeded: the same rows).
"""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.output import RETRIED_DIR, OutputDir, fsync_dir
from pipeline.schema import key_strings


def _replace_part(out: OutputDir, part: Path, keep: pa.Table) -> None:
    aside = out.tmp / (part.name + ".replaced")
    committed = part.stat()
    part.rename(aside)
    fsync_dir(out.data)
    if keep.num_rows:   # the rewritten part keeps the old one's time: "first committed" stays true
        os.utime(out.commit(keep), ns=(committed.st_atime_ns, committed.st_mtime_ns))
    aside.unlink()


def _in_commit_order(out: OutputDir) -> list[Path]:
    return sorted(out.part_files(), key=lambda p: (p.stat().st_mtime_ns, p.name))


def dedupe(out: OutputDir) -> int:
    """Keep the first committed copy of each key (parts in commit order) → rows removed."""
    seen: set[str] = set()
    removed = 0
    for part in _in_commit_order(out):
        table = pq.read_table(part)
        keep = []
        for i, key in enumerate(key_strings(table["id"], table["sample_index"]).to_pylist()):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        if len(keep) < table.num_rows:
            removed += table.num_rows - len(keep)
            _replace_part(out, part, table.take(pa.array(keep, pa.int64())))
    return removed


def retry_errors(out: OutputDir) -> int:
    """Move every error row out of ``data/`` into ``retried/`` (one file per part) → rows moved."""
    moved = 0
    archive = out.root / RETRIED_DIR
    for part in out.part_files():
        table = pq.read_table(part)
        failed = pc.fill_null(pc.equal(table["finish_reason"], "error"), False)
        errors = table.filter(failed)
        if not errors.num_rows:
            continue
        archive.mkdir(exist_ok=True)
        # The record of what failed (written whole, then renamed; a crash before the part is rewritten
        # makes the rerun write the record again, under its own run id).
        record = out.tmp / f"{part.stem}.{out.run_id}.parquet"
        pq.write_table(errors, record)
        os.replace(record, archive / record.name)
        _replace_part(out, part, table.filter(pc.invert(failed)))
        moved += errors.num_rows
    return moved
