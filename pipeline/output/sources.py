"""Where a part's rows come from, recorded in its footer, and what resume makes of it.

Every output row is one sample of one input row: its coordinate is (input file, ``row * n +
sample_index``), the *flat index* (``n`` = samples per row). A part records its rows' coordinates
in output row order as runs ``(file, first flat index, count)`` -- one run per block of consecutive
rows, so a part of a million rows holds a few thousand runs, not a million keys. That is enough to

- resume (:class:`DoneSet`): merge every part's runs into sorted, disjoint row ranges per input file
  and sample index; finished files are not read again, partially done files filter their own rows
  in their own read task;
- find duplicates without reading a row: two runs that overlap are the same keys committed twice;
- repair a part (drop some rows by position) and still say exactly what it holds.

Ids are unique (``inputs/checks.py``), so a coordinate and an (id, sample_index) key are the same thing.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

import pyarrow as pa

SOURCES_KEY = b"orthrus.sources"


@dataclass(frozen=True)
class Pending:
    """Which samples of one file are still to generate: per sample index, the sorted, disjoint
    row ranges already committed (``starts[s]``, ``ends[s]``). Empty arrays: nothing done."""

    n: int
    starts: tuple[np.ndarray, ...]
    ends: tuple[np.ndarray, ...]

    def within(self, lo: int, hi: int) -> "Pending":
        """Only the ranges that meet rows ``[lo, hi)`` (what one row group's task needs)."""
        keep = [(e > lo) & (s < hi) for s, e in zip(self.starts, self.ends)]
        return Pending(self.n, tuple(s[k] for s, k in zip(self.starts, keep)),
                       tuple(e[k] for e, k in zip(self.ends, keep)))

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every sample of rows ``[lo, hi)`` is done (the row group need not be read)."""
        return all(bool(((s <= lo) & (e >= hi)).any()) for s, e in zip(self.starts, self.ends))

    def samples(self, rows: np.ndarray) -> pa.ListArray:
        """The pending sample indices of each row, as a list per row (empty: the row is done)."""
        done = np.zeros((len(rows), self.n), dtype=bool)
        for s in range(self.n):
            if len(self.starts[s]):
                i = np.searchsorted(self.starts[s], rows, side="right") - 1
                done[:, s] = (i >= 0) & (rows < self.ends[s][np.maximum(i, 0)])
        keep = ~done
        offsets = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int32)
        values = np.nonzero(keep)[1].astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def runs_of(files: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Runs ``[R, 3]`` (file, first flat index, count) of consecutive coordinates, in row order."""
    if not len(flat):
        return np.zeros((0, 3), np.int64)
    files, flat = files.astype(np.int64), flat.astype(np.int64)
    breaks = np.flatnonzero((np.diff(files) != 0) | (np.diff(flat) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(flat)]]))
    return np.stack([files[starts], flat[starts], counts], axis=1)


@dataclass(frozen=True)
class PartSources:
    """The coordinates of one part's rows: ``runs`` index ``files``; ``n`` samples per row."""

    n: int
    files: tuple[str, ...]
    runs: np.ndarray                 # [R, 3] int64, output row order

    @property
    def num_rows(self) -> int:
        return int(self.runs[:, 2].sum()) if len(self.runs) else 0

    def coordinates(self) -> tuple[np.ndarray, np.ndarray]:
        """(file index, flat index) of every row, in order (a repair task's work: grows with rows)."""
        counts = self.runs[:, 2]
        files = np.repeat(self.runs[:, 0], counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return files, np.repeat(self.runs[:, 1], counts) + within

    def keep(self, mask: np.ndarray) -> "PartSources":
        """The sources of the rows where ``mask`` is true (after a repair dropped the others)."""
        files, flat = self.coordinates()
        return PartSources(self.n, self.files, runs_of(files[mask], flat[mask]))

    def encode(self) -> bytes:
        runs = base64.b64encode(np.ascontiguousarray(self.runs, dtype="<i8").tobytes()).decode()
        return json.dumps({"n": self.n, "files": list(self.files), "runs": runs}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "PartSources":
        d = json.loads(raw)
        runs = np.frombuffer(base64.b64decode(d["runs"]), dtype="<i8").reshape(-1, 3).astype(np.int64)
        return cls(int(d["n"]), tuple(d["files"]), runs)

    def flat_ranges(self) -> dict[str, np.ndarray]:
        """Per file, the runs as ``[start, end)`` flat ranges ``[k, 2]`` (unmerged)."""
        out: dict[str, list] = {}
        for i, path in enumerate(self.files):
            mine = self.runs[self.runs[:, 0] == i]
            out[path] = np.stack([mine[:, 1], mine[:, 1] + mine[:, 2]], axis=1)
        return out


def merge(ranges: np.ndarray) -> tuple[np.ndarray, int]:
    """Sorted disjoint union of ``[start, end)`` ranges, and how many indices were covered twice."""
    if not len(ranges):
        return np.zeros((0, 2), np.int64), 0
    r = ranges[np.lexsort((ranges[:, 1], ranges[:, 0]))]
    reach = np.maximum.accumulate(r[:, 1])
    new = np.concatenate([[True], r[1:, 0] > reach[:-1]])     # touching ranges join: a file done in two parts is done
    starts = r[new, 0]
    ends = np.maximum.reduceat(r[:, 1], np.flatnonzero(new))
    covered = int((ends - starts).sum())
    return np.stack([starts, ends], axis=1), int((r[:, 1] - r[:, 0]).sum()) - covered


def subtract(ranges: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """``ranges`` minus ``minus`` (both sorted and disjoint)."""
    out, j = [], 0
    for a, b in ranges.tolist():
        while j < len(minus) and minus[j, 1] <= a:
            j += 1
        k = j
        while a < b and k < len(minus) and minus[k, 0] < b:
            if minus[k, 0] > a:
                out.append((a, int(minus[k, 0])))
            a = max(a, int(minus[k, 1]))
            k += 1
        if a < b:
            out.append((a, b))
    return np.array(out, np.int64).reshape(-1, 2)


class DoneSet:
    """Every committed coordinate, as merged flat ranges per input file (under each part's n).

    Built from part footers; its size grows with files, parts and the gaps a kill leaves, never
    with rows.
    """

    def __init__(self) -> None:
        self._pieces: dict[tuple[str, int], list[np.ndarray]] = {}
        self.rows = 0

    def add(self, sources: PartSources) -> None:
        for path, ranges in sources.flat_ranges().items():
            self._pieces.setdefault((path, sources.n), []).append(ranges)
        self.rows += sources.num_rows

    def merged(self) -> tuple[dict[tuple[str, int], np.ndarray], int]:
        """Merged ranges per (file, n), and the number of coordinates committed more than once."""
        out, twice = {}, 0
        for key, pieces in self._pieces.items():
            out[key], extra = merge(np.concatenate(pieces))
            twice += extra
        return out, twice

    def pending(self, files: tuple[str, ...], file_rows: tuple[int, ...], n: int) -> dict[str, Pending | None]:
        """Per input file with anything left: None (untouched) or its :class:`Pending`; finished
        files are absent."""
        merged, _ = self.merged()
        by_file: dict[str, list[tuple[int, np.ndarray]]] = {}
        for (path, part_n), ranges in merged.items():
            by_file.setdefault(path, []).append((part_n, ranges))
        out: dict[str, Pending | None] = {}
        for path, rows in zip(files, file_rows):
            if path not in by_file:
                out[path] = None
                continue
            pending = _per_sample(by_file[path], n)
            done = all(len(s) == 1 and s[0] == 0 and e[0] >= rows for s, e in zip(pending.starts, pending.ends))
            if rows and not done:
                out[path] = pending
        return out


def _per_sample(pieces: list[tuple[int, np.ndarray]], n: int) -> Pending:
    """Flat ranges (each under its part's n) → merged row ranges per sample index < n."""
    per: list[list[np.ndarray]] = [[] for _ in range(n)]
    for part_n, ranges in pieces:
        a, b = ranges[:, 0], ranges[:, 1]
        for s in range(min(part_n, n)):
            lo, hi = -((s - a) // part_n), -((s - b) // part_n)    # ceil((a - s) / part_n), ceil((b - s) / part_n)
            keep = hi > lo
            per[s].append(np.stack([lo[keep], hi[keep]], axis=1))
    merged = [merge(np.concatenate(p))[0] if p else np.zeros((0, 2), np.int64) for p in per]
    return Pending(n, tuple(m[:, 0].copy() for m in merged), tuple(m[:, 1].copy() for m in merged))
