"""The start-up split (``pipeline/report/startup.py``), without Ray: its arithmetic and line, and the
route of its moments from a read task through the prepare step into an actor's batch record and
the driver's tracker. The same split end to end, on a real Ray head: ``tests/e2e/test_pipeline_ray.py``."""
from __future__ import annotations

import asyncio

from pipeline import schema as S
from pipeline.config import AuditConfig
from pipeline.actor.stage import GenerationStage, StagePlan
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import ReadSpec, _timed_read, row_group_tasks
from pipeline.report.startup import CHAIN, INPUT_SIDE, DriverClock, render_split, startup_split
from pipeline.report.throughput import ThroughputTracker
from pipeline.run.job import preflight
from support.job_inputs import job_config, write_shard


def test_the_split_is_the_chain_of_moments_and_the_input_side_beside_it():
    clock = DriverClock(command=100.0, ray_init=103.0, ray_ready=107.5)
    split = startup_split(clock, {"start": 118.0, "end": 121.25},
                          {"read_start": 109.0, "read_end": 109.5, "prepare_start": 110.0, "prepare_end": 114.0},
                          first_batch=122.0)
    assert split == {"before_ray_s": 3.0, "ray_start_s": 4.5, "actor_start_s": 10.5, "model_load_s": 3.25,
                     "input_wait_s": 0.75, "first_read_s": 0.5, "first_prepare_s": 4.0, "total_s": 22.0}
    assert sum(split[k] for k in CHAIN) == split["total_s"]
    assert sum(split[k] for k in INPUT_SIDE) <= split["total_s"] - split["before_ray_s"] - split["ray_start_s"]
    assert render_split(split) == [
        "  start-up split before Ray 3.0 s | Ray 4.5 | actor start 10.5 | model load 3.2 | waiting for input 0.8 "
        "= 22.0 s from the command (beside the actor: first read 0.5 s, first prepare 4.0 s)"]


def test_unknown_moments_leave_their_phases_unknown_and_skewed_clocks_never_go_negative():
    # run() without a clock (a caller that started Ray itself), a stand-in stage without records
    assert set(startup_split(None, None, None, None).values()) == {None}
    assert render_split(startup_split(None, None, None, None)) == []
    split = startup_split(None, {"start": 50.0, "end": 49.0}, None, first_batch=60.0)   # another node's clock
    assert (split["model_load_s"], split["input_wait_s"], split["total_s"]) == (0.0, 11.0, None)
    assert "before Ray n/a s | Ray n/a" in render_split(split)[0]


def test_the_moments_ride_from_the_read_through_the_prepare_into_the_record_and_the_tracker(
        tmp_path, tiny_orthrus_dir):
    write_shard(tmp_path, "a.parquet", id=["a", "b", "c"], prompt=["def a(x):", "def b(y):", "def c():"])
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"}, sampling={"max_new_tokens": 4})
    inputs = preflight(cfg).inputs
    read = _timed_read(row_group_tasks(inputs, {inputs.files[0]: None})[0], ReadSpec.of(inputs), 1)
    batch = preprocess_batch(read, PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    times = batch[S.STARTUP].to_pylist()
    assert times[1:] == [None, None]          # one record per block, on its first row
    t = times[0]
    assert t["read_start"] <= t["read_end"] <= t["prepare_start"] <= t["prepare_end"]
    stage = GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False,
                                      audit=AuditConfig(fraction=0.0), batch_records=True))
    out = asyncio.run(stage(batch))
    assert S.STARTUP not in out.column_names               # consumed: never an output column
    record = out[S.BATCH].drop_null().to_pylist()[0]
    assert record["input"] == t
    assert record["constructed"]["start"] <= record["constructed"]["end"] <= record["started"]
    tracker = ThroughputTracker()
    tracker.add(out)
    split = tracker.startup(DriverClock(command=t["read_start"] - 2, ray_init=t["read_start"] - 1,
                                        ray_ready=t["read_start"]))
    assert all(split[k] >= 0 for k in (*CHAIN[2:], *INPUT_SIDE, "total_s"))
