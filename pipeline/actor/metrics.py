"""Live metrics of each generation actor, exported through Ray's metrics API.

Ray's metrics agent on every node serves them on its Prometheus endpoint
(``http://<node>:<metrics-export-port>/metrics``, names prefixed ``ray_``; counters end in
``_total``), which the Ray dashboard's Metrics view and any Prometheus scrape read. Each actor
updates them when a batch is done, from the rows it is about to return, tagged with the actor
(``pid@node``):

    orthrus_rows{status=ok|error}              rows returned (counter)
    orthrus_completion_tokens                  tokens generated (counter)
    orthrus_cycles, orthrus_draft_tokens,
    orthrus_verified_draft_tokens,
    orthrus_accepted_draft_tokens              speculation counters (rates come from these)
                                               (these five: the columns ``pipeline/columns.py`` gives a metric)
    orthrus_tokens_per_cycle                   accepted drafts + 1 per cycle, this actor so far (gauge)
    orthrus_draft_acceptance                   accepted / proposed drafts, this actor so far (gauge)
    orthrus_slot_occupancy                     busy slots / slots since the previous batch ended (gauge)
    orthrus_prefill_tokens                     prompt tokens computed by prefills (counter)
    orthrus_prefix_cache_hit_tokens            prompt tokens shared from cached pages or a running slot instead (counter)
    orthrus_prefix_cache_hit_rate              hit / (hit + computed) prompt tokens, this actor so far (gauge)
    orthrus_kv_pages_in_use, orthrus_kv_pages_peak
                                               KV pages held by rows at the batch's end, and the most so far (gauges)
    orthrus_preemptions                        rows preempted for want of KV pages (counter)
    orthrus_audit_rows{result=match|diverged}  rows re-decoded by the lossless audit (counter)
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from orthrus import EngineStats
from orthrus.metrics import tokens_per_cycle
from pipeline.actor.records import EngineSnapshot
from pipeline.columns import METRICS
from pipeline.output.stats import column_sum, prefix_cache_hit_rate


class ActorMetrics:
    """The metrics of one actor; ``record`` adds one finished batch."""

    def __init__(self, actor: str) -> None:
        from ray.util.metrics import Counter, Gauge

        tags = {"actor": actor}

        def counter(name: str, description: str, *extra: str) -> Counter:
            c = Counter(name, description=description, tag_keys=("actor", *extra))
            c.set_default_tags(tags)
            return c

        def gauge(name: str, description: str) -> Gauge:
            g = Gauge(name, description=description, tag_keys=("actor",))
            g.set_default_tags(tags)
            return g

        self.rows = counter("orthrus_rows", "Rows returned by the generation actor.", "status")
        # One counter per column the table of columns gives a metric (its rows' sums), by column.
        self.sums = {name: counter(metric, f"Summed over rows: {doc}.") for name, (metric, doc) in METRICS.items()}
        self.audit = counter("orthrus_audit_rows", "Rows re-decoded with plain AR by the lossless audit.", "result")
        self.tpc = gauge("orthrus_tokens_per_cycle", "Accepted drafts + 1 per cycle, this actor so far.")
        self.acceptance = gauge("orthrus_draft_acceptance", "Accepted / proposed draft tokens, this actor so far.")
        self.occupancy = gauge("orthrus_slot_occupancy", "Busy engine slots / slots since the previous batch.")
        self.prefill = counter("orthrus_prefill_tokens", "Prompt tokens computed by prefills.")
        self.hits = counter("orthrus_prefix_cache_hit_tokens",
                            "Prompt tokens shared from cached KV pages or a running slot instead of prefilled.")
        self.hit_rate = gauge("orthrus_prefix_cache_hit_rate",
                              "Prefix-cache hit / (hit + computed) prompt tokens, this actor so far.")
        self.kv_in_use = gauge("orthrus_kv_pages_in_use", "KV cache pages held by rows at the batch's end.")
        self.kv_peak = gauge("orthrus_kv_pages_peak", "The most KV cache pages rows held at once, so far.")
        self.preemptions = counter("orthrus_preemptions", "Rows preempted for want of KV pages (recomputed later).")
        self._totals = dict.fromkeys(METRICS, 0)    # those sums over this actor's batches (the ratios' gauges)
        self._last: tuple[int, int] | None = None   # (iterations, busy slot-iterations) at the last record

    def record(self, table: pa.Table, engine: EngineSnapshot, since: EngineStats) -> None:
        """Add a finished batch: its output rows (after detokenization), the engine's counters now
        (cumulative), and their growth since the previous batch ended."""
        ok = table.filter(pc.not_equal(table["finish_reason"], "error"))
        if ok.num_rows:
            self.rows.inc(ok.num_rows, tags={"status": "ok"})
        if table.num_rows > ok.num_rows:
            self.rows.inc(table.num_rows - ok.num_rows, tags={"status": "error"})
        for name, metric in self.sums.items():
            value = column_sum(ok[name])
            if value:
                metric.inc(value)
                self._totals[name] += value
        cycles, drafts, accepted = (self._totals[name] for name in
                                    ("num_cycles", "num_draft_tokens", "num_accepted_draft_tokens"))
        if cycles:
            self.tpc.set(tokens_per_cycle(accepted, cycles))
        if drafts:
            self.acceptance.set(accepted / drafts)
        audited = table.filter(pc.is_valid(table["audit_match"]))
        matches = column_sum(pc.cast(audited["audit_match"], pa.int64()))
        for result, count in (("match", matches), ("diverged", audited.num_rows - matches)):
            if count:
                self.audit.inc(count, tags={"result": result})
        now = engine.stats
        start = self._last or (0, 0)
        if now.iterations > start[0]:
            busy, iterations = now.busy_slot_iterations - start[1], now.iterations - start[0]
            self.occupancy.set(busy / (iterations * engine.slots))
        self._last = (now.iterations, now.busy_slot_iterations)
        for metric, value in ((self.prefill, since.prefill_tokens), (self.hits, since.prefix_cache_hit_tokens),
                              (self.preemptions, since.preemptions)):
            if value:
                metric.inc(value)
        if engine.kv is not None:
            self.kv_in_use.set(engine.kv.in_use)
            self.kv_peak.set(engine.kv.peak)
        rate = prefix_cache_hit_rate(now.prefill_tokens, now.prefix_cache_hit_tokens)
        if rate is not None:
            self.hit_rate.set(rate)
