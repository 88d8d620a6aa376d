"""Per-actor throughput of this run, gathered by the driver from the batch records it receives
(one ``pipeline/actor/records.py`` ``BATCH_RECORD`` per actor call; bounded by batches, not rows)."""
from __future__ import annotations

import time
from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.report.startup import DriverClock, earliest, startup_split


class ThroughputTracker:
    """Rows, generated tokens and busy seconds per actor.

    Busy seconds are the actor engine's time inside steps (batches in flight overlap, so their wall
    times do not add up); blocks without engine counters fall back to summing each call's wall time.
    """

    def __init__(self) -> None:
        self.rows: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.gpu_ids: dict[str, str] = {}
        self._first: tuple[float, int, int] | None = None     # (time, total tokens, total rows) at the first block
        self._last = 0.0
        self._first_call: float | None = None            # wall clock at which an actor first got a batch
        # per actor, the calls' occupancy records (``actor/records.OCCUPANCY``) that bound its windows (first
        # and last arrival, latest end), not every call: the driver's memory grows with actors, not batches
        self._occupancy: dict[str, list[dict]] = defaultdict(list)
        self._engine_ms: dict[str, tuple[int, int]] = {}
        self._first_actor: dict | None = None            # the constructor times of the actor that got the first batch
        self._first_input: dict | None = None            # the first prepared rows' read and prepare times

    def add(self, block: pa.Table) -> None:
        """Account the batch records of one block (the records ride on each batch's first row)."""
        if S.BATCH not in block.column_names:
            return
        col = block[S.BATCH]
        self.add_records(col.filter(pc.is_valid(col)).to_pylist())

    def add_records(self, records: list[dict]) -> None:
        """Account finished actor calls (one record each)."""
        for r in records:
            actor = r["actor"]
            self.rows[actor] += r["rows"]
            self.tokens[actor] += r["tokens"] or 0
            self.gpu_ids[actor] = r["gpu_ids"]
            self.seconds[actor] += r["seconds"]
            self._keep(actor, r["occupancy"])
            if r["started"] is not None and (self._first_call is None or r["started"] < self._first_call):
                self._first_call, self._first_actor = r["started"], r.get("constructed")
            self._first_input = earliest([self._first_input, r.get("input")], "prepare_end")
        self._last = time.time()
        if self._first is None:
            self._first = (self._last, self.total_tokens, self.total_rows)

    def _keep(self, actor: str, c: dict | None) -> None:
        """Keep a call's occupancy record (``actor/records.OCCUPANCY``) if it bounds one of the actor's windows."""
        if not c:
            return
        arrived, ended = c["arrival"]["engine_ms"], c["end"]["engine_ms"]   # the actor's busy window
        lo, hi = self._engine_ms.get(actor, (arrived, ended))
        self._engine_ms[actor] = (min(lo, arrived), max(hi, ended))
        kept = self._occupancy[actor]
        if not kept:
            kept.extend([c, c, c])
            return
        first, last, end = kept
        arrival = lambda x: x["arrival"]["iterations"]  # noqa: E731
        kept[:] = [min(first, c, key=arrival), max(last, c, key=arrival),
                   max(end, c, key=lambda x: x["end"]["iterations"])]

    def startup_seconds(self, start: float) -> float | None:
        """Seconds from ``start`` until an actor got its first batch (Ray, actor start, model load);
        without that timestamp, until the first block."""
        if self._first_call is not None:
            return self._first_call - start
        return None if self._first is None else self._first[0] - start

    def startup(self, clock: DriverClock | None) -> dict[str, float | None]:
        """The start-up split (``report/startup.py``) from the driver's moments and the batch records'."""
        return startup_split(clock, self._first_actor, self._first_input, self._first_call)

    def steady_tokens_per_second(self) -> float | None:
        """Tokens/s from the moment an actor got its first batch to the last block: the rate a long
        job runs at, start-up excluded. (From the first *block* instead when that moment is unknown;
        with several batches in flight per actor, blocks come in bursts, so that is only a fallback.)"""
        return self._steady(self.total_tokens, self._first and self._first[1])

    def steady_rows_per_second(self) -> float | None:
        """Rows/s over the same window as :meth:`steady_tokens_per_second`: the figure to read when
        outputs are a token or a few (labelling, scoring), where tokens/s says little."""
        return self._steady(self.total_rows, self._first and self._first[2])

    def _steady(self, total: int, at_first_block: int | None) -> float | None:
        if self._first_call is not None and self._last > self._first_call:
            return total / (self._last - self._first_call)
        if self._first is None or self._last <= self._first[0]:
            return None
        return (total - at_first_block) / (self._last - self._first[0])

    def slot_occupancy(self) -> dict[str, float | None]:
        """Mean fraction of engine slots busy per decode iteration, pooled over actors.

        ``until_input_ran_out``: from each actor's first batch arrival to its last one (while more
        input kept coming, so every idle slot was a slot the design failed to fill);
        ``whole_run``: from the first arrival to the last batch's end (includes the final drain).
        """
        window = {"until_input_ran_out": [0, 0], "whole_run": [0, 0]}   # [busy slot-iters, slot-iters]
        for calls in self._occupancy.values():
            if not calls:
                continue
            first, last, end = calls
            start = first["arrival"]
            for name, until in (("until_input_ran_out", last["arrival"]), ("whole_run", end["end"])):
                window[name][0] += until["busy_slot_iterations"] - start["busy_slot_iterations"]
                window[name][1] += (until["iterations"] - start["iterations"]) * first["slots"]
        return {name: (busy / total if total else None) for name, (busy, total) in window.items()}

    @property
    def total_rows(self) -> int:
        """Rows generated (including error rows) in this run."""
        return sum(self.rows.values())

    @property
    def total_tokens(self) -> int:
        """Completion tokens generated in this run."""
        return sum(self.tokens.values())

    def _busy(self, actor: str) -> float:
        if actor not in self._engine_ms:
            return self.seconds[actor]
        lo, hi = self._engine_ms[actor]
        return (hi - lo) / 1000

    def report(self) -> list[dict]:
        """One entry per actor, sorted by actor id."""
        return [{"actor": a, "gpu_ids": [int(g) if g.isdigit() else g for g in self.gpu_ids[a].split(",") if g],
                 "rows": self.rows[a], "completion_tokens": self.tokens[a],
                 "busy_seconds": round(self._busy(a), 3),
                 "tokens_per_second": round(self.tokens[a] / self._busy(a), 2) if self._busy(a) else None}
                for a in sorted(self.rows)]
