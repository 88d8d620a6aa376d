"""Trusting and watching a run, without Ray: the lossless audit, per-row timings, the row timeout,
the progress display and the summary's audit and cost sections.

The same features run end to end on a real Ray head (metrics read back from the Prometheus
endpoint, the wall-time guard, ``--resume``) in ``tests/e2e/test_observability_ray.py``.
"""
from __future__ import annotations

import asyncio
import io

import pyarrow as pa
import pytest
import torch

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline.actor.audit import audit_statistics, first_divergence, is_audited
from pipeline.config import AuditConfig
from pipeline.actor.engine_loop import EngineLoop
from pipeline.run.job import preflight
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import read_file
from pipeline.report.progress import Progress
from pipeline.actor.stage import GenerationStage, StagePlan
from pipeline.report.summary import render_table
from support.hang import HANG_S
from support.job_inputs import job_config, write_shard
from support.paths import TOKENIZER_DIR

BUNDLED = str(TOKENIZER_DIR)   # the bundled trained model (its tokenizer dir is the checkpoint)


def _batch(tmp_path, cfg):
    inputs = preflight(cfg).inputs
    return preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))


def _stage(cfg, fraction: float = 0.0, row_timeout_s: float | None = None,
           batch_records: bool = False) -> GenerationStage:
    return GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False,
                                     audit=AuditConfig(fraction=fraction, max_batch_size=2),
                                     row_timeout_s=row_timeout_s, batch_records=batch_records))


# ---------------------------------------------------------------- the audit: selection and comparison

def test_audit_selection_is_a_stable_hash_of_the_id():
    ids = [f"row-{i}" for i in range(4000)]
    tenth = {i for i in ids if is_audited(i, 0.1)}
    assert 300 < len(tenth) < 500                                # about the fraction asked for
    assert tenth == {i for i in ids if is_audited(i, 0.1)}       # the same rows on every call (and run)
    assert {i for i in ids if is_audited(i, 0.05)} <= tenth      # a larger fraction audits a superset
    assert not any(is_audited(i, 0.0) for i in ids) and all(is_audited(i, 1.0) for i in ids)


@pytest.mark.parametrize("spec, ar, expected", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([7], [8], 0),
    ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 2], 2), ([], [], None)])
def test_first_divergence(spec, ar, expected):
    assert first_divergence(spec, ar) == expected


def test_audit_statistics_and_table_line():
    table = pa.table({"id": ["a", "b", "c", "d", "e"], "sample_index": [0] * 5,
                      "audit_match": pa.array([True, None, False, True, False]),
                      "audit_first_divergence": pa.array([None, None, 7, None, 3], pa.int64())})
    stats = audit_statistics(table, 0.5)
    assert (stats["rows_audited"], stats["exact_matches"], stats["diverged"]) == (4, 2, 2)
    assert stats["first_divergence"] == {"min": 3, "median": 7, "max": 7}
    assert stats["diverged_examples"] == [{"id": "c", "sample_index": 0, "first_divergence": 7},
                                          {"id": "e", "sample_index": 0, "first_divergence": 3}]
    assert audit_statistics(table.drop_columns(["audit_match", "audit_first_divergence"]), 0)["rows_audited"] == 0


@pytest.mark.slow
def test_audited_greedy_rows_equal_plain_ar_in_float32(tmp_path):
    """The bundled model, float32, speculative: every audited greedy row matches plain AR token for
    token (stop strings included); sampled rows are never audited."""
    n = 10
    write_shard(tmp_path, "a.parquet", id=[f"r{i}" for i in range(n)], prompt=[f"def f{i}(x, y):" for i in range(n)],
           temperature=pa.array([None] * (n - 2) + [0.8, 0.8], pa.float64()))
    cfg = job_config(tmp_path, BUNDLED, prompt={"chat_template": "off"},
                  sampling={"max_new_tokens": 40, "stop": ["\ndef "]},
                  engine={"max_batch_size": 4, "dtype": "float32"})
    rows = asyncio.run(_stage(cfg, fraction=1.0)(_batch(tmp_path, cfg))).to_pylist()
    assert len(rows) == n
    greedy, sampled = rows[:-2], rows[-2:]
    assert all(r["audit_match"] is True and r["audit_first_divergence"] is None for r in greedy)
    assert all(r["audit_match"] is None and r["audit_first_divergence"] is None for r in sampled)
    assert any(r["num_accepted_draft_tokens"] > 0 for r in greedy)       # speculation really happened
    assert any(r["finish_reason"] == "stop" for r in greedy)


def test_the_audit_reports_where_a_wrong_decoding_diverges(tmp_path, tiny_orthrus_dir):
    """Power check: if the engine's output were not the model's AR output, the audit says so. Here
    the audit engine decodes a perturbed copy of the model; divergence indices are checked
    against a direct comparison."""
    write_shard(tmp_path, "a.parquet", id=[f"r{i}" for i in range(6)], prompt=[f"def g{i}(a):" for i in range(6)])
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"}, sampling={"max_new_tokens": 12},
                  engine={"max_batch_size": 3})
    stage = _stage(cfg, fraction=1.0)
    other = OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir))
    with torch.no_grad():
        other.lm_head.weight.add_(torch.randn_like(other.lm_head.weight))
    stage.loop.engines["audit"] = OrthrusEngine(other, max_batch_size=2, speculative=False)
    batch = _batch(tmp_path, cfg)
    rows = asyncio.run(stage(batch)).to_pylist()
    truth = OrthrusEngine(other, max_batch_size=6, speculative=False).generate(
        [r["prompt_token_ids"] for r in batch["__request"].to_pylist()], SamplingParams(max_new_tokens=12))
    mine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir)), max_batch_size=6).generate(
        [r["prompt_token_ids"] for r in batch["__request"].to_pylist()], SamplingParams(max_new_tokens=12))
    expected = [first_divergence(a.token_ids, b.token_ids) for a, b in zip(mine, truth)]
    assert [r["audit_first_divergence"] for r in rows] == expected and any(e is not None for e in expected)
    assert [r["audit_match"] for r in rows] == [e is None for e in expected]


# ---------------------------------------------------------------- per-row time and the row timeout

def test_per_row_times_add_up_with_one_slot(tmp_path, tiny_orthrus_dir):
    """One slot: rows run one after another, so each row waited about as long as the rows before it ran."""
    write_shard(tmp_path, "a.parquet", id=["a", "b", "c"], prompt=["def a():", "def b():", "def c():"])
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"}, sampling={"max_new_tokens": 30},
                  engine={"max_batch_size": 1})
    rows = asyncio.run(_stage(cfg)(_batch(tmp_path, cfg))).to_pylist()
    engine = [r["time_in_engine_s"] for r in rows]
    waiting = [r["time_waiting_s"] for r in rows]
    wall = rows[0]["batch_wall_seconds"]
    assert all(t > 0 for t in engine) and sum(engine) <= wall
    assert waiting[0] < waiting[1] < waiting[2]
    assert waiting[2] >= 0.9 * (engine[0] + engine[1])
    assert all(r["batch_wall_seconds"] == wall for r in rows)


@pytest.mark.slow
def test_row_timeout_turns_long_rows_into_error_rows_and_frees_their_slots(tmp_path, tiny_orthrus_dir):
    write_shard(tmp_path, "a.parquet", id=["long1", "long2", "short"], prompt=["def a():", "def b():", "def c():"],
           max_new_tokens=pa.array([400, 400, 2], pa.int64()))
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"},
                  engine={"max_batch_size": 2, "max_seq_len": 512})
    rows = {r["id"]: r for r in asyncio.run(_stage(cfg, row_timeout_s=0.001)(_batch(tmp_path, cfg))).to_pylist()}
    assert len(rows) == 3
    for rid in ("long1", "long2"):
        r = rows[rid]
        assert r["finish_reason"] == "error" and r["generated_text"] is None
        assert "row timeout: aborted after" in r["error"] and "behaviour.row_timeout_s=0.001" in r["error"]
    # the short row was admitted only when a long one gave up its slot; it may time out too, no other way
    assert rows["short"]["finish_reason"] == "length" or "row timeout: aborted after" in rows["short"]["error"]
    untimed = {r["id"]: r for r in asyncio.run(_stage(cfg, row_timeout_s=HANG_S)(_batch(tmp_path, cfg))).to_pylist()}
    assert all(r["finish_reason"] != "error" for r in untimed.values())


def test_engine_loop_row_timeout_returns_the_tokens_so_far(tiny_orthrus_dir):
    model = OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir))
    engine = OrthrusEngine(model, max_batch_size=1, max_seq_len=512)
    loop = EngineLoop(engine, row_timeout_s=0.02)
    out = asyncio.run(loop.run([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=480)] * 2))
    assert [o.finish_reason for o in out] == ["abort", "abort"] and loop.timed_out == 2
    assert all(o.engine_seconds >= 0.02 and len(o.token_ids) < 480 for o in out)
    assert not engine.has_unfinished_requests() and engine.num_running == 0


# ---------------------------------------------------------------- prefill counts: batch records and metrics

class _FakeMetric:
    """Stands in for ray.util.metrics' Counter and Gauge (no Ray): keeps the value per tag set."""

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.values = name, {}

    def set_default_tags(self, tags):
        pass

    def inc(self, value, tags=None):
        key = tuple(sorted((tags or {}).items()))
        self.values[key] = self.values.get(key, 0) + value

    def set(self, value, tags=None):
        self.values[tuple(sorted((tags or {}).items()))] = value


def test_batch_records_and_metrics_count_prefilled_and_prefix_cache_hit_tokens(tmp_path, tiny_orthrus_dir,
                                                                              monkeypatch):
    """Each batch record carries the prompt tokens its actor's engine prefilled (computed) and copied
    from a slot holding them (hits) since the previous batch: the records add up to the engine's
    counts, and the n samples of a row share their prompt (hits). The live metrics count the same
    deltas. ``engine.prefix_cache`` reaches the engine."""
    import ray.util.metrics

    from pipeline.actor.metrics import ActorMetrics
    from pipeline import schema as S

    monkeypatch.setattr(ray.util.metrics, "Counter", _FakeMetric)
    monkeypatch.setattr(ray.util.metrics, "Gauge", _FakeMetric)
    write_shard(tmp_path, "a.parquet", id=["a", "b", "c"], prompt=["def a(x):", "def b(y, z):", "def c():"])
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"},
                  sampling={"max_new_tokens": 6, "n": 2}, engine={"max_batch_size": 4})
    stage = _stage(cfg, batch_records=True)
    stage.metrics = ActorMetrics("test")
    batch = _batch(tmp_path, cfg)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in batch["__request"].to_pylist())
    records = [r for _ in range(2) for r in asyncio.run(stage(batch))[S.BATCH].drop_null().to_pylist()]
    assert len(records) == 2
    computed = sum(r["since"]["prefill_tokens"] for r in records)             # EngineStats' names
    hits = sum(r["since"]["prefix_cache_hit_tokens"] for r in records)
    assert computed + hits == 2 * prompt_tokens                       # every admitted prompt token, once
    assert (computed, hits) == (stage.engine.stats.prefill_tokens, stage.engine.stats.prefix_cache_hit_tokens)
    assert computed > 0 and hits > 0
    assert [r["occupancy"]["slots"] for r in records] == [4, 4]
    assert records[1]["occupancy"]["end"]["iterations"] >= records[1]["occupancy"]["arrival"]["iterations"] > 0
    m = stage.metrics
    assert (m.prefill.values[()], m.hits.values.get((), 0)) == (computed, hits)
    assert m.hit_rate.values[()] == pytest.approx(hits / (computed + hits))
    import orthrus      # the stage builds its engines through the package's (lazy) name

    built, engine = [], orthrus.OrthrusEngine
    monkeypatch.setattr(orthrus, "OrthrusEngine", lambda *a, **kw: built.append(a[1].prefix_cache) or engine(*a, **kw))
    _stage(job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"}, engine={"prefix_cache": False}))
    assert built == [False]


# ---------------------------------------------------------------- progress and the summary's table

def test_progress_log_lines_have_count_rate_and_eta():
    lines: list[str] = []
    p = Progress(expected=10, done_before=2, echo=lines.append, bar=False, interval_s=3600)
    p.update(3, 120.0)
    p.update(1, 130.0)          # within the interval: no line
    p.update(4, None)           # the last rows: always a line
    assert len(lines) == 2
    assert lines[0].startswith("[orthrus] progress 5/10 rows (50.0%) | 120 tok/s | ETA ")
    assert lines[1].startswith("[orthrus] progress 10/10 rows (100.0%) | n/a tok/s | ETA 0:00:00")


def test_progress_bar_on_a_terminal():
    stream = io.StringIO()
    p = Progress(expected=8, done_before=0, bar=True, stream=stream)
    p.update(8, 99.0)
    p.close()
    assert "8/8" in stream.getvalue() and "99 tok/s" in stream.getvalue()


def test_summary_table_shows_audit_cost_prefill_and_kv_cache():
    summary = {"rows": {"total": 2, "ok": 2, "error": 0, "finish_reason": {"length": 2}},
               "tokens": {"prompt": 4, "completion": 20},
               "prefill": {"computed_tokens": 3000, "prefix_cache_hit_tokens": 1000, "prefix_cache_hit_rate": 0.25},
               "kv_cache": {"page_size": 16, "pages": 512, "pages_in_use_mean": 120.5, "pages_in_use_peak": 300,
                            "rows_in_flight_mean": 7.5, "preemptions": 3, "recomputed_tokens": 1200},
               "speculation": {"tokens_per_cycle": {"mean_per_row": 2.0, "token_weighted": 2.0, "pooled": 2.0,
                                                    "tpf_pooled": 1.0},
                               "accepted_draft_tokens": 5, "draft_tokens": 10, "draft_acceptance_rate": 0.5,
                               "acceptance_rate_by_position": [0.5]},
               "audit": {"rows_audited": 2, "exact_matches": 1, "diverged": 1,
                         "first_divergence": {"min": 4, "median": 4, "max": 4}},
               "run": {"rows_generated": 2, "completion_tokens": 20, "wall_seconds": 10.0, "tokens_per_second": 2.0,
                       "rows_skipped_as_finished": 0, "actors": [],
                       "cost": {"device": "gpu", "device_seconds_reserved": 20.0, "device_seconds_busy": 8.0,
                                "tokens_per_device_hour": 3600.0}}}
    text = render_table(summary, "out")
    assert "audit          2 greedy rows re-decoded with plain AR: 1 exact, 1 diverged (first differing token at " \
           "index 4..4, median 4)" in text
    assert "cost           20 GPU-seconds held (8 busy) = 3,600 tokens per GPU-hour" in text
    assert "prefill        3,000 prompt tokens computed, 1,000 shared by the prefix cache (25% hits)" in text
    assert ("kv cache       120 pages held on average, peak 300 of 512 (16 tokens each); 7.5 rows in flight; "
            "3 preemptions (1,200 tokens recomputed)") in text
    unknown = {**summary, "prefill": {"computed_tokens": None, "prefix_cache_hit_tokens": None,
                                      "prefix_cache_hit_rate": None},   # parts written without the counts
               "kv_cache": {"pages": None}}
    assert "prefill " not in render_table(unknown, "out") and "kv cache" not in render_table(unknown, "out")


def test_an_exclusive_group_runs_alone_on_the_device_audit_engine_included(tiny_orthrus_dir):
    model = OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir))
    steps_during_exclusive = []

    class WatchedAudit(OrthrusEngine):      # the real engine, recording when it is stepped
        def step(self):
            steps_during_exclusive.append(loop._running_exclusive)
            return super().step()

    loop = EngineLoop(OrthrusEngine(model, max_batch_size=2), WatchedAudit(model, max_batch_size=2, speculative=False))
    prompts, params = [[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=30)] * 2

    async def main():
        return await asyncio.gather(loop.run(prompts, params, exclusive=True), loop.run(prompts, params, engine="audit"),
                                    loop.run(prompts, params, exclusive=True))

    alone, audit, again = asyncio.run(main())
    assert steps_during_exclusive and not any(steps_during_exclusive)
    assert [o.token_ids for o in alone] == [o.token_ids for o in audit] == [o.token_ids for o in again]


def test_cost_per_billion_output_tokens_and_rows_ended_at_prefill_in_summary_and_table():
    from pipeline.report.throughput import ThroughputTracker
    from pipeline.run.job import _cost
    from pipeline.run.resources import Placement

    tracker = ThroughputTracker()
    tracker.add_records([{"actor": "a", "gpu_ids": "", "rows": 10, "tokens": 2_000_000, "seconds": 5.0,
                          "started": None, "occupancy": None}])
    # 2 replicas x 1 CPU core x 43.2 s = 0.001 CPU-days for 2M tokens: 0.5 CPU-days per billion
    cpu = _cost(Placement(replicas=2, gpus_per_replica=0, cpus_per_replica=1), 43.2, tracker)
    assert cpu["device"] == "cpu" and cpu["device_days_per_billion_output_tokens"] == pytest.approx(0.5)
    # on GPUs the device is the GPU: 4 replicas x 0.5 GPU x 43.2 s, whatever CPUs they also hold
    gpu = _cost(Placement(replicas=4, gpus_per_replica=0.5, cpus_per_replica=8), 43.2, tracker)
    assert gpu["device"] == "gpu" and gpu["device_days_per_billion_output_tokens"] == pytest.approx(0.5)
    assert _cost(Placement(1, 0, 1), 10.0, ThroughputTracker())["device_days_per_billion_output_tokens"] is None
    summary = {"rows": {"total": 10, "ok": 10, "error": 0, "finish_reason": {"length": 10}},
               "tokens": {"prompt": 40, "completion": 2_000_000},
               "speculation": {"tokens_per_cycle": {"mean_per_row": None, "token_weighted": None, "pooled": None,
                                                    "tpf_pooled": None},
                               "accepted_draft_tokens": 0, "draft_tokens": 0, "draft_acceptance_rate": None,
                               "acceptance_rate_by_position": [], "rows_ended_at_prefill": 10, "cycles": 0},
               "run": {"rows_generated": 10, "completion_tokens": 2_000_000, "wall_seconds": 43.2,
                       "tokens_per_second": 1.0, "rows_skipped_as_finished": 0, "actors": [], "cost": cpu,
                       "startup_seconds": 3.0, "steady_tokens_per_second": 12.5, "steady_rows_per_second": 12.5,
                       "slot_occupancy": None}}
    text = render_table(summary, "out")
    assert ("cost           86 CPU-seconds held (5 busy) = 83,333,333 tokens per CPU-hour = 0.500 CPU-days per "
            "billion output tokens") in text
    # every row ended at its prefill (max_new_tokens 1): what that means, not "n/a"
    assert "then 12.5 tok/s = 12.5 rows/s; no decode iterations (every row ended at its prefill)" in text
    assert "tokens/cycle   none: all 10 rows ended at their prefill, before any cycle" in text
    assert "n/a" not in text and "drafts " not in text


def test_compile_time_travels_from_the_batch_records_to_the_summary():
    """``EngineStats.compile_ms`` in each batch record's ``since`` is summed into the footer's engine
    aggregate and reported as ``summary.json`` ``engine.compile_seconds`` (None for older parts)."""
    import pyarrow as pa
    from dataclasses import asdict

    from orthrus import EngineStats
    from pipeline import schema as S
    from pipeline.actor.records import STATS
    from pipeline.output.stats import prefill_of_block
    from pipeline.report import summary

    since = [asdict(EngineStats(iterations=3, compile_ms=ms)) for ms in (1200, 300)]
    block = pa.table({S.BATCH: pa.array([{"since": s} for s in since], pa.struct([pa.field("since", STATS)]))})
    engine = prefill_of_block(block)
    assert engine["compile_ms"] == 1500 and engine["iterations"] == 6
    assert summary._compile_seconds(engine) == 1.5
    assert summary._compile_seconds(None) is None and summary._compile_seconds({"iterations": 1}) is None
