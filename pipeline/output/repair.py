"""Repairs of an existing output directory, run with the lease held, before a resumed run.

- ``dedupe``: keep the first committed copy of each (id, sample_index) (``--dedupe``);
- ``retry_errors``: take the rows committed as errors out of ``data/`` (kept in ``retried/``), so
  the resumed run generates them again (``--retry-errors``).

Both start from the parts' footers (``sources.py``, ``stats.py``), so only the parts that need it
are read: for ``dedupe`` the parts whose coordinates overlap an earlier part's (or their own), for
``retry_errors`` the parts whose footer counts errors. Each of those is rewritten by a Ray task (in
the calling process when Ray is not running), without some of its rows, in one atomic step
(``replace_part``), so ``data/`` never shows a key twice and never loses a row it should keep; a
rewritten part keeps its name (and, locally, its commit time) and gets a footer that says exactly
what it still holds. A crash before a rewrite leaves the part as it was, and the repair runs again.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.output.directory import RETRIED_DIR, OutputDir, archive, replace_part
from pipeline.output.sources import merge, subtract
from pipeline.tasks import map_tasks

__all__ = ["RETRIED_DIR", "dedupe", "retry_errors"]


def _prefill(footer) -> dict | None:
    """The engine's prefill counts in a part's footer: a rewrite keeps them (``stats.of_table``)."""
    return (footer.stats or {}).get("prefill")


def _overlaps(footers) -> list[tuple[str, dict[str, np.ndarray]]]:
    """(part, {file: flat ranges committed earlier}) for each part holding a coordinate twice.

    Walks the parts in commit order keeping the union of what came before, per file: bounded by
    parts and runs, never by rows."""
    seen: dict[tuple[str, int], np.ndarray] = {}
    affected = []
    for f in footers:
        n, drop, twice = f.sources.n, {}, False
        for path, ranges in f.sources.flat_ranges().items():
            merged, repeats = merge(ranges)
            before = seen.get((path, n), np.zeros((0, 2), np.int64))
            common = subtract(merged, subtract(merged, before))
            if len(common) or repeats:
                drop[path], twice = common, True
            seen[(path, n)] = merge(np.concatenate([before, merged]))[0]
        if twice:
            affected.append((f.path, drop))
    return affected


def _dedupe_part(out: OutputDir, part: str, drop: dict[str, np.ndarray]) -> int:
    """Drop the rows of ``part`` committed earlier (``drop``) or earlier in the part → rows removed."""
    from pipeline.output.directory import read_footer

    footer = read_footer(part, out.fs)
    sources = footer.sources
    table = out.read_part(part)
    files, flat = sources.coordinates()
    keep = np.ones(len(flat), bool)
    for i, path in enumerate(sources.files):
        ranges = drop.get(path)
        if ranges is not None and len(ranges):
            mine = files == i
            at = np.searchsorted(ranges[:, 0], flat[mine], side="right") - 1
            inside = (at >= 0) & (flat[mine] < ranges[np.maximum(at, 0), 1])
            keep[np.flatnonzero(mine)[inside]] = False
    _, first = np.unique(np.stack([files, flat], axis=1), axis=0, return_index=True)
    once = np.zeros(len(flat), bool)
    once[first] = True
    keep &= once
    if keep.all():
        return 0
    replace_part(out, part, table.filter(pa.array(keep)), sources.keep(keep), _prefill(footer))
    return int((~keep).sum())


def dedupe(out: OutputDir) -> int:
    """Keep the first committed copy of each key (parts in commit order) → rows removed."""
    affected = _overlaps(out.footers())
    out.check_lease()
    return sum(map_tasks(_dedupe_part, [(out, part, drop) for part, drop in affected]))


def _retry_part(out: OutputDir, part: str, run_id: str) -> int:
    """Move ``part``'s error rows to ``retried/`` and rewrite it without them → rows moved."""
    from pipeline.output.directory import read_footer

    footer = read_footer(part, out.fs)
    sources = footer.sources
    table = out.read_part(part)
    failed = np.asarray(pc.fill_null(pc.equal(table["finish_reason"], "error"), False).to_numpy(zero_copy_only=False))
    if not failed.any():
        return 0
    # The record of what failed first (a crash before the part is rewritten makes the rerun write
    # the record again, under its own run id), then the part without them.
    stem = part.rsplit("/", 1)[-1].removesuffix(".parquet")
    archive(out, f"{stem}.{run_id}.parquet", table.filter(pa.array(failed)))
    replace_part(out, part, table.filter(pa.array(~failed)), sources.keep(~failed), _prefill(footer))
    return int(failed.sum())


def retry_errors(out: OutputDir) -> int:
    """Move every error row out of ``data/`` into ``retried/`` (one file per affected part) → rows moved."""
    parts = [f.path for f in out.footers() if f.stats is None or f.stats.get("error", 1)]
    out.check_lease()
    return sum(map_tasks(_retry_part, [(out, p, out.run_id) for p in parts]))
