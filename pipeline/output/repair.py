"""Repairs of an existing output directory, run with the lease held, before a resumed run.

- ``dedupe``: keep the first committed copy of each (id, sample_index) (``--dedupe``);
- ``retry_errors``: take the rows committed as errors out of ``data/`` (kept in ``retried/``), so
  the resumed run generates them again (``--retry-errors``).

Both rewrite a part without some of its rows in one atomic step (``replace_part``: a rename over
the old file locally, one PUT over the old object on an object store), so ``data/`` never shows a
key twice and never loses a row it should keep; a rewritten part keeps its name (and, locally, its
commit time). A crash before a rewrite leaves the part as it was, and the repair runs again.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.output.directory import RETRIED_DIR, CommittedParts
from pipeline.rows.schema import key_strings

__all__ = ["RETRIED_DIR", "dedupe", "retry_errors"]


def dedupe(out: CommittedParts) -> int:
    """Keep the first committed copy of each key (parts in commit order) → rows removed."""
    seen: set[str] = set()
    removed = 0
    for part in out.commit_order():
        table = out.read_part(part)
        keep = []
        for i, key in enumerate(key_strings(table["id"], table["sample_index"]).to_pylist()):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        if len(keep) < table.num_rows:
            removed += table.num_rows - len(keep)
            out.replace_part(part, table.take(pa.array(keep, pa.int64())))
    return removed


def retry_errors(out: CommittedParts) -> int:
    """Move every error row out of ``data/`` into ``retried/`` (one file per part) → rows moved."""
    moved = 0
    for part in out.part_files():
        table = out.read_part(part)
        failed = pc.fill_null(pc.equal(table["finish_reason"], "error"), False)
        errors = table.filter(failed)
        if not errors.num_rows:
            continue
        # The record of what failed first (a crash before the part is rewritten makes the rerun write
        # the record again, under its own run id), then the part without them.
        stem = str(part).rsplit("/", 1)[-1].removesuffix(".parquet")
        out.archive(f"{stem}.{out.run_id}.parquet", errors)
        out.replace_part(part, table.filter(pc.invert(failed)))
        moved += errors.num_rows
    return moved
