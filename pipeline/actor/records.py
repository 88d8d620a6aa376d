"""The per-batch record the job's driver reads (``schema.BATCH``, one per actor call), with the
engine's counters as Arrow structs derived from ``orthrus.EngineStats``: a counter the engine adds
reaches the record, the footers and the driver with no edit here.

``occupancy``: the counters (every ``EngineStats`` field, plus ``engine_ms``, the wall time inside
engine steps) when the batch arrived and when it ended, and the engine's slots. ``since``: the
counters' growth since the actor's previous batch record (per-actor deltas, so records add up;
the part footers' engine aggregate is summed from it, ``output/stats.py``). ``kv_pages``: the KV
page pool at the batch's end (``orthrus.KVPages``; its peak is the most pages the engine held).
``constructed`` and ``input``: the moments of the job's start-up split (``report/startup.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import pyarrow as pa

from orthrus import EngineStats, KVPages
from pipeline import schema as S

STATS = pa.struct([pa.field(f.name, pa.int64()) for f in fields(EngineStats)])
KV_PAGES = pa.struct([pa.field(f.name, pa.int64()) for f in fields(KVPages)])
COUNTERS = pa.struct([*STATS, pa.field("engine_ms", pa.int64())])
OCCUPANCY = pa.struct([pa.field("slots", pa.int64()), pa.field("arrival", COUNTERS), pa.field("end", COUNTERS)])
BATCH_RECORD = pa.struct([
    pa.field("actor", pa.string()), pa.field("gpu_ids", pa.string()), pa.field("call_id", pa.string()),
    pa.field("rows", pa.int64()), pa.field("tokens", pa.int64()),
    pa.field("seconds", pa.float64()),         # the call's wall time
    pa.field("started", pa.float64()),         # wall clock (epoch s) at which the actor got the batch
    pa.field("occupancy", OCCUPANCY),          # null: no engine counters (a stand-in stage)
    pa.field("since", STATS),                  # null: no engine counters
    pa.field("kv_pages", KV_PAGES),            # the page pool at the batch's end; null: no engine
    # the actor's constructor (wall clock): when it began (its process is up, its modules imported) and ended
    pa.field("constructed", pa.struct([pa.field("start", pa.float64()), pa.field("end", pa.float64())])),
    pa.field("input", S.STARTUP_TIMES),        # the batch's earliest-prepared rows' times; null: none carried
])


@dataclass(frozen=True)
class EngineSnapshot:
    """The main engine's counters at one moment, its slots, and its busy time so far."""

    stats: EngineStats
    slots: int
    engine_ms: int               # wall time spent inside engine steps (the actor's busy time)
    kv: KVPages | None = None    # the KV page pool now

    def counters(self) -> dict:
        """As a :data:`COUNTERS` struct value."""
        return {**asdict(self.stats), "engine_ms": self.engine_ms}


def growth(later: EngineStats, earlier: EngineStats) -> EngineStats:
    """``later - earlier``, never below 0 (an engine reset after a failure restarts its counters)."""
    d = later - earlier
    return EngineStats(*(max(0, getattr(d, f.name)) for f in fields(d)))


def occupancy_record(arrival: EngineSnapshot, end: EngineSnapshot) -> dict:
    """The counters at a batch's arrival and at its end (:data:`OCCUPANCY`)."""
    return {"slots": end.slots, "arrival": arrival.counters(), "end": end.counters()}
