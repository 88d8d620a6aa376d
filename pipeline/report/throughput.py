"""Per-actor throughput of this run, gathered by the driver from the blocks it commits."""
from __future__ import annotations

import time
from collections import defaultdict

import pyarrow as pa

from pipeline.rows import schema as S


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
        self._calls: set[str] = set()
        self._first: tuple[float, int] | None = None     # (time, total tokens) at the first block
        self._last = 0.0
        self._first_call: float | None = None            # wall clock at which an actor first got a batch
        self._occupancy: dict[str, list[list[int]]] = defaultdict(list)   # per actor call, see stage._flat

    def add(self, batch: pa.Table) -> None:
        """Account one block of generated rows (before it is cast to the output schema)."""
        cols = batch.select([S.ACTOR, S.GPU_IDS, S.CALL_ID, S.CALL_SECONDS, "num_completion_tokens",
                             S.OCCUPANCY, S.CALL_STARTED]).to_pydict()
        for actor, gpus, call, secs, tokens, occupancy, started in zip(*cols.values()):
            self.rows[actor] += 1
            self.tokens[actor] += tokens or 0
            self.gpu_ids[actor] = gpus
            if call not in self._calls:
                self._calls.add(call)
                self.seconds[actor] += secs
                self._occupancy[actor].append(occupancy)
                if started is not None:
                    self._first_call = started if self._first_call is None else min(self._first_call, started)
        self._last = time.time()
        if self._first is None:
            self._first = (self._last, self.total_tokens)

    def startup_seconds(self, start: float) -> float | None:
        """Seconds from ``start`` until an actor got its first batch (Ray, actor start, model load);
        without that timestamp, until the first block."""
        if self._first_call is not None:
            return self._first_call - start
        return None if self._first is None else self._first[0] - start

    def steady_tokens_per_second(self) -> float | None:
        """Tokens/s from the moment an actor got its first batch to the last block: the rate a long
        job runs at, start-up excluded. (From the first *block* instead when that moment is unknown;
        with several batches in flight per actor, blocks come in bursts, so that is only a fallback.)"""
        if self._first_call is not None and self._last > self._first_call:
            return self.total_tokens / (self._last - self._first_call)
        if self._first is None or self._last <= self._first[0]:
            return None
        return (self.total_tokens - self._first[1]) / (self._last - self._first[0])

    def slot_occupancy(self) -> dict[str, float | None]:
        """Mean fraction of engine slots busy per decode iteration, pooled over actors.

        ``until_input_ran_out``: from each actor's first batch arrival to its last one (while more
        input kept coming, so every idle slot was a slot the design failed to fill);
        ``whole_run``: from the first arrival to the last batch's end (includes the final drain).
        """
        window = {"until_input_ran_out": [0, 0], "whole_run": [0, 0]}   # [busy slot-iters, slot-iters]
        for calls in self._occupancy.values():
            calls = [c for c in calls if c]
            if not calls:
                continue
            first, last = min(calls, key=lambda c: c[0]), max(calls, key=lambda c: c[0])
            end = max(calls, key=lambda c: c[2])
            slots = first[4]
            for name, (iters, busy) in (("until_input_ran_out", (last[0], last[1])), ("whole_run", (end[2], end[3]))):
                window[name][0] += busy - first[1]
                window[name][1] += (iters - first[0]) * slots
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
        calls = [c for c in self._occupancy.get(actor, []) if c and len(c) >= 7]
        if not calls:
            return self.seconds[actor]
        return (max(c[6] for c in calls) - min(c[5] for c in calls)) / 1000

    def report(self) -> list[dict]:
        """One entry per actor, sorted by actor id."""
        return [{"actor": a, "gpu_ids": [int(g) if g.isdigit() else g for g in self.gpu_ids[a].split(",") if g],
                 "rows": self.rows[a], "completion_tokens": self.tokens[a],
                 "busy_seconds": round(self._busy(a), 3),
                 "tokens_per_second": round(self.tokens[a] / self._busy(a), 2) if self._busy(a) else None}
                for a in sorted(self.rows)]
