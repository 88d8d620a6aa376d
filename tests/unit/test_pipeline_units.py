"""Pipeline pieces without a Ray cluster: preflight, preprocessing, stop strings, output commits, stats."""
from __future__ import annotations

import asyncio

from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from pipeline.config import BehaviourConfig, ConfigError, EngineConfig, ResourcesConfig
from pipeline.run.job import preflight
from pipeline.output.directory import OutputDir
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline import schema as S
from pipeline.actor.postprocess import detokenize_batch
from pipeline.inputs.preprocess import PreprocessPlan, derive_seed, preprocess_batch
from pipeline.inputs.source import read_file
from pipeline.output.sources import Pending
from pipeline.output.sources import PartSources
from pipeline.run.resources import check_engine_placement, resolve_placement
from pipeline.actor.stage import GenerationStage, StagePlan
from pipeline.schema import OUTPUT_FIELDS, output_schema, to_output_table
from orthrus.metrics import acceptance_by_position
from pipeline.report.summary import row_statistics
from support.job_inputs import job_config, write_shard
from support.paths import TOKENIZER_DIR



# ---------------------------------------------------------------- preflight (before any model loads)

def test_preflight_accepts_good_inputs_without_loading_weights(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=["x", "y"], prompt=["p", "q"], source=["s", "t"], seed=[1, None])
    plan = preflight(job_config(tmp_path, weightless_model)).inputs
    assert plan.num_rows == 2 and plan.id_column == "id" and plan.passthrough == ("source",)
    assert plan.override_columns == ("seed",) and plan.messages_column is None


@pytest.mark.parametrize("setup, message", [
    (lambda t: None, r"input.paths\[0\] .*no such file"),
    (lambda t: (t / "in").mkdir() or (t / "in" / "bad.parquet").write_bytes(b"not parquet"),
     r"bad.parquet is not a readable Parquet file"),
    (lambda t: write_shard(t, "a.parquet", id=["x"], text=["p"]), r"input.prompt_column.*input.messages_column"),
    (lambda t: (write_shard(t, "a.parquet", id=["x"], prompt=["p"]), write_shard(t, "b.parquet", prompt=["q"])),
     r"input.id_column.*missing from 1 input file\(s\), e.g. .*b.parquet"),
    (lambda t: write_shard(t, "a.parquet", id=["x"], prompt=["p"], completion=["c"]), r"'completion' clashes"),
    (lambda t: write_shard(t, "a.parquet", id=["x"], prompt=[1]), r"'prompt' has type int64"),
    (lambda t: write_shard(t, "a.parquet", id=["x"], prompt=["p"], top_k=["a"]), r"'top_k' has type string"),
])
def test_preflight_rejects_bad_inputs_naming_file_or_field(tmp_path, weightless_model, setup, message):
    setup(tmp_path)
    with pytest.raises(ConfigError, match=message):
        preflight(job_config(tmp_path, weightless_model))


def test_preflight_rejects_bad_model_paths(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["p"])
    with pytest.raises(ConfigError, match="model.path: '/nonexistent/model' is neither"):
        preflight(job_config(tmp_path, Path("/nonexistent/model")))
    (weightless_model / "config.json").unlink()
    with pytest.raises(ConfigError, match="model.path: .* has no config.json"):
        preflight(job_config(tmp_path, weightless_model))


def test_preflight_output_dir_rules(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["p"])
    inside = job_config(tmp_path, weightless_model, output={"path": str(tmp_path / "in" / "out")})
    with pytest.raises(ConfigError, match="is inside the input"):
        preflight(inside)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="--resume .*--overwrite"):
        preflight(job_config(tmp_path, weightless_model))
    with pytest.raises(ConfigError, match="not an Orthrus output directory"):
        preflight(job_config(tmp_path, weightless_model, behaviour={"overwrite": True}))
    assert (out / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="chat_template is off, so rows need the prompt column"):
        write_shard(tmp_path, "a.parquet", id=["x"], messages=['[{"role": "user", "content": "hi"}]'])
        preflight(job_config(tmp_path, weightless_model, prompt={"chat_template": "off"},
                          output={"path": str(tmp_path / "o2")}))


# ---------------------------------------------------------------- preprocessing

def test_preprocess_mixed_rows_become_error_rows(tmp_path, weightless_model):
    msgs = [[{"role": "user", "content": "hello"}], None, None, [{"role": "user", "content": None}], None, None]
    batch = pa.table({
        "id": ["ok-msg", "ok-prompt", "neither", "bad-msg", "bad-temp", "bad-topk"],
        "prompt": [None, "def f():", None, None, "x", "y"],
        "messages": pa.array(msgs, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        "temperature": [None, 0.5, None, None, -1.0, None],
        "top_k": [None, None, None, None, None, 0.5],
        "source": list("abcdef"),
    })
    (tmp_path / "in").mkdir()
    pq.write_table(batch, tmp_path / "in" / "a.parquet")
    cfg = job_config(tmp_path, weightless_model, sampling={"n": 2, "seed": 7, "temperature": 0.9})
    inputs = preflight(cfg).inputs
    plan = PreprocessPlan(inputs=inputs, model=cfg.model, prompt=cfg.prompt, sampling=cfg.sampling)
    # sample 1 of row 1 ("ok-prompt") is already committed: the read task leaves it out
    done = Pending(2, (np.array([], np.int64), np.array([1])), (np.array([], np.int64), np.array([2])))
    from pipeline.inputs.source import ReadSpec, read_row_group, row_group_tasks
    (task,) = row_group_tasks(inputs, {inputs.files[0]: done})
    out = preprocess_batch(read_row_group(task, ReadSpec.of(inputs), 2), plan).to_pylist()
    assert [(r["id"], r["sample_index"]) for r in out] == [
        ("ok-msg", 0), ("ok-msg", 1), ("ok-prompt", 0), ("neither", 0), ("neither", 1), ("bad-msg", 0),
        ("bad-msg", 1), ("bad-temp", 0), ("bad-temp", 1), ("bad-topk", 0), ("bad-topk", 1)]  # ok-prompt/1 done
    errors = {r["id"]: r["error"] for r in out}
    assert errors["ok-msg"] is None and errors["ok-prompt"] is None
    assert errors["neither"] == "prompt and messages are both missing"
    assert "messages[0] must have string 'role' and 'content'" in errors["bad-msg"]
    assert "column 'temperature' must be a finite number >= 0" in errors["bad-temp"]
    assert "'top_k' must be an integer" in errors["bad-topk"]
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    first = out[0]
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert first["__request"]["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert first["num_input_tokens"] == len(first["__request"]["prompt_token_ids"]) and first["source"] == "a"
    assert first["__request"]["temperature"] == 0.9 and out[2]["__request"]["temperature"] == 0.5  # row override wins
    assert "sampling_params" not in first and out[3]["__request"] is None        # "neither": no request
    assert first["seed"] == derive_seed(7, "ok-msg", 0) != out[1]["seed"]


def test_preprocess_batch_from_a_file_lacking_optional_columns(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=["a"], prompt=["p"], seed=[5], source=["s"])
    write_shard(tmp_path, "b.parquet", id=["b"], messages=['[{"role": "user", "content": "hi"}]'])
    cfg = job_config(tmp_path, weightless_model)
    inputs = preflight(cfg).inputs
    plan = PreprocessPlan(inputs=inputs, model=cfg.model, prompt=cfg.prompt, sampling=cfg.sampling)
    row = preprocess_batch(read_file(inputs, 1, 1), plan).to_pylist()[0]  # no prompt/seed/source
    assert row["error"] is None and row["seed"] == derive_seed(0, "b", 0) and "source" not in row
    assert preprocess_batch(read_file(inputs, 0, 1), plan).to_pylist()[0]["seed"] == 5


def test_derived_seeds_are_deterministic_and_distinct():
    seeds = {derive_seed(0, f"r{i}", s) for i in range(100) for s in range(3)}
    assert len(seeds) == 300 and all(0 <= s < 2 ** 63 for s in seeds)
    assert derive_seed(1, "a", 0) == derive_seed(1, "a", 0) != derive_seed(2, "a", 0)


# ---------------------------------------------------------------- generation stage (real engine, no Ray)

def test_stage_stop_token_ids_and_engine_request_checks(tmp_path, tiny_orthrus_dir):
    tok = AutoTokenizer.from_pretrained(tiny_orthrus_dir)
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir)), max_batch_size=2)
    first = engine.generate([tok("def f(x):")["input_ids"]], SamplingParams(max_new_tokens=1))[0].token_ids[0]
    write_shard(tmp_path, "a.parquet", id=["stop", "long"], prompt=["def f(x):", "x = 1\n" * 60])
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"},
                  sampling={"max_new_tokens": 3, "stop_token_ids": [first]}, engine={"max_seq_len": 64})
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, 1), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    stage = GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False))
    rows = {r["id"]: r for r in asyncio.run(stage(batch)).to_pylist()}
    stop = rows["stop"]  # stopped on its first token: counted, but not part of the text
    assert (stop["finish_reason"], stop["num_generated_tokens"], stop["generated_text"]) == ("stop", 1, "")
    assert stop["generated_tokens"] == [first] and stop["token_logprobs"] is None
    assert stop["accept_length_histogram"] and stop["model"] == str(tiny_orthrus_dir) and stop["error"] is None
    long = rows["long"]
    assert long["finish_reason"] == "error" and long["generated_text"] is None
    assert "invalid request: prompt has" in long["error"] and "max_seq_len=64" in long["error"]


# ---------------------------------------------------------------- detokenize + stop strings

def test_detokenize_uses_the_engines_text_and_decodes_the_rest():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ids = tok("    return x\n\ndef g():", add_special_tokens=False)["input_ids"]
    batch = pa.table({S.TEXT_IDS: pa.array([ids, ids, None], pa.list_(pa.int32())),
                      S.ENGINE_TEXT: ["cut here", None, None], "finish_reason": ["stop", "length", "error"],
                      "error": [None, None, "boom"]})
    rows = detokenize_batch(batch, tok).to_pylist()
    assert [r["generated_text"] for r in rows] == ["cut here", tok.decode(ids), None]
    assert [r["error"] for r in rows] == [None, None, "boom"] and S.ENGINE_TEXT not in rows[0]


# ---------------------------------------------------------------- output dir: atomic commits, resume keys

def test_output_commits_are_atomic_and_keyed(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {"model": "m"})
    schema = output_schema([pa.field("source", pa.string())])
    rows = pa.table({"id": ["a", "b"], "sample_index": [0, 1], "finish_reason": ["length", "error"],
                     "source": [None, None]})
    # input rows 0 and 1 of f.parquet, samples 0 and 1 of n = 2: flat indices 0 and 3
    sources = PartSources(2, ("/in/f.parquet",), np.array([[0, 0, 1], [0, 3, 1]]))
    part = out.commit(to_output_table(rows, schema), sources)
    assert Path(part).parent == out.store.root / "data" and not list(out.tmp.iterdir())
    (out.tmp / "part-x.parquet.inprogress").write_bytes(b"half a file")  # what a kill leaves behind
    assert out.read().schema == schema and out.read().num_rows == 2
    done, total, _ = out.done()
    assert total["rows"] == 2 and total["error"] == 1 and done.rows == 2
    pending = done.pending(("/in/f.parquet", "/in/g.parquet"), (3, 1), 2)
    assert pending["/in/g.parquet"] is None                     # untouched: read in full
    left = pending["/in/f.parquet"].samples(np.arange(3)).to_pylist()
    assert left == [[1], [0], [0, 1]]                           # row 0 sample 0 and row 1 sample 1 are done
    out2 = OutputDir(str(tmp_path / "out"))
    out2.prepare(BehaviourConfig(resume=True), {"model": "m"})
    assert not list(out2.tmp.iterdir()) and out2.read().num_rows == 2
    out2.prepare(BehaviourConfig(overwrite=True), {"model": "m"})
    assert out2.read().num_rows == 0


# ---------------------------------------------------------------- resources and statistics

def test_placement_auto_and_cpu_headroom():
    p = resolve_placement(ResourcesConfig(), {"CPU": 2})
    assert (p.replicas, p.gpus_per_replica, p.use_gpu) == (1, 0.0, False)
    g = resolve_placement(ResourcesConfig(), {"CPU": 16, "GPU": 4})
    assert (g.replicas, g.gpus_per_replica, g.use_gpu) == (4, 1.0, True)
    with pytest.raises(ConfigError, match="resources.replicas x resources.cpus_per_replica"):
        resolve_placement(ResourcesConfig(replicas=2), {"CPU": 2})


def test_flash_attention_needs_gpu_replicas():
    flash = EngineConfig(attention="flash")
    check_engine_placement(flash, resolve_placement(ResourcesConfig(), {"CPU": 16, "GPU": 4}))
    check_engine_placement(EngineConfig(), resolve_placement(ResourcesConfig(), {"CPU": 2}))
    with pytest.raises(ConfigError, match="engine.attention='flash' needs GPU replicas"):
        check_engine_placement(flash, resolve_placement(ResourcesConfig(), {"CPU": 2}))


def test_acceptance_statistics():
    rate, cond = acceptance_by_position([2, 1, 0, 1])  # 4 cycles: L = 0, 0, 1, 3
    assert rate == [0.5, 0.25, 0.25] and cond == [0.5, 0.5, 1.0]
    t = pa.table({"id": ["a", "b", "c"], "sample_index": [0, 0, 0], "finish_reason": ["length", "stop", "error"], "error": [None, None, "x"],
                  "num_prompt_tokens": [3, 4, None], "num_completion_tokens": [8, 2, None],
                  "num_cycles": [2, 2, None], "num_forward_passes": [5, 5, None], "num_draft_tokens": [6, 6, None],
                  "num_accepted_draft_tokens": [6, 0, None], "tokens_per_cycle": [4.0, 1.0, None],
                  "accept_length_histogram": [[0, 0, 0, 2], [2, 0, 0, 0], None]},
                 schema=pa.schema([f for f in OUTPUT_FIELDS if f.name in {
                     "id", "sample_index", "finish_reason", "error", "num_prompt_tokens", "num_completion_tokens", "num_cycles",
                     "num_forward_passes", "num_draft_tokens", "num_accepted_draft_tokens", "tokens_per_cycle",
                     "accept_length_histogram"}]))
    s = row_statistics(t)
    assert s["rows"] == {"total": 3, "ok": 2, "error": 1, "finish_reason": {"length": 1, "stop": 1, "error": 1},
                         "duplicate_keys": 0}
    assert row_statistics(pa.concat_tables([t, t.slice(0, 1)]))["rows"]["duplicate_keys"] == 1
    tpc = s["speculation"]["tokens_per_cycle"]
    assert tpc["mean_per_row"] == 2.5 and tpc["pooled"] == 10 / 4 and tpc["token_weighted"] == (32 + 2) / 10
    assert s["speculation"]["accept_length_histogram"] == [2, 0, 0, 2]
    assert s["error_examples"] == [{"id": "c", "error": "x"}]


def test_throughput_tracker_separates_startup_from_steady_rate(monkeypatch):
    from pipeline import schema as S
    from pipeline.actor.records import BATCH_RECORD
    from pipeline.report.throughput import ThroughputTracker

    def block(call: str, tokens: int, occupancy: dict | None, started: float | None = None) -> pa.Table:
        record = {"actor": "a", "gpu_ids": "", "call_id": call, "rows": 2, "tokens": 2 * tokens, "seconds": 1.0,
                  "started": started, "occupancy": occupancy}
        return pa.table({S.BATCH: pa.array([record, None], BATCH_RECORD)})

    def occ(iterations: tuple[int, int], busy: tuple[int, int], slots: int, engine_ms: tuple[int, int]) -> dict:
        """Engine counters at arrival and at the end (actor/records.OCCUPANCY)."""
        at = lambda i: {"iterations": iterations[i], "busy_slot_iterations": busy[i],  # noqa: E731
                        "engine_ms": engine_ms[i]}
        return {"slots": slots, "arrival": at(0), "end": at(1)}

    # The tracker's clock, injected: the "sleeps" below advance it, so a loaded machine cannot
    # stretch an interval past the bounds (a real sleep of 0.2 s can take far longer there).
    clock = SimpleNamespace(now=1_000_000.0)
    monkeypatch.setattr("pipeline.report.throughput.time", SimpleNamespace(time=lambda: clock.now))
    tracker = ThroughputTracker()
    start = clock.now
    assert tracker.startup_seconds(start) is None and tracker.steady_tokens_per_second() is None
    clock.now += 0.21
    # engine counters (iterations, busy slot-iterations) at arrival and at the end, 4 slots:
    # 10 iterations with all 4 slots busy between the two arrivals, then a drain at 1 slot busy;
    # and the engine's busy milliseconds at arrival and at the end (the two calls overlap)
    tracker.add(block("c1", 50, occ((0, 12), (0, 48), 4, (0, 900))))     # the first block's tokens are startup's
    clock.now += 0.21
    tracker.add(block("c2", 10, occ((10, 20), (40, 58), 4, (700, 1500))))
    assert tracker.startup_seconds(start) >= 0.2
    assert 20 / 0.5 < tracker.steady_tokens_per_second() <= 20 / 0.2
    assert tracker.report()[0]["busy_seconds"] == 1.5 and tracker.total_tokens == 120
    assert tracker.slot_occupancy() == {"until_input_ran_out": 1.0, "whole_run": 58 / 80}
    # with the actors' batch start times: steady = all tokens from the first batch's start on
    timed = ThroughputTracker()
    begin = clock.now
    timed.add(block("c1", 50, occ((0, 12), (0, 48), 4, (0, 900)), started=begin + 0.1))
    timed.add(block("c2", 10, occ((10, 20), (40, 58), 4, (700, 1500)), started=begin + 0.05))
    clock.now += 0.31
    timed.add(block("c3", 0, None, started=begin + 0.3))
    assert 0.04 < timed.startup_seconds(begin) < 0.06
    assert 120 / 0.5 < timed.steady_tokens_per_second() <= 120 / 0.25


def test_request_column_reads_back_column_wise_per_row_settings_and_seeds():
    from orthrus import SamplingParams
    from pipeline.requests.request import read_requests, to_arrow

    rows = [([1, 2, 3], SamplingParams(max_new_tokens=1, seed=1)), None,
            ([4], SamplingParams(max_new_tokens=1, seed=2)),
            ([5, 6], SamplingParams(temperature=0.5, top_k=3, max_new_tokens=4, stop=("\n",), seed=3)),
            ([7, 8], SamplingParams(max_new_tokens=1, seed=None))]
    column = pa.chunked_array([to_arrow(rows[:2]), to_arrow(rows[2:])])     # batches arrive chunked
    back = read_requests(column)
    assert len(back) == 5 and back.prompts == [r[0] if r else None for r in rows]
    assert back.params == [r[1] if r else None for r in rows]               # every setting, each row's seed
    assert back.prompt_ids.offsets.to_pylist()[-1] == len(back.prompt_ids.values)
    assert read_requests(pa.chunked_array([], to_arrow([]).type)).params == []


def test_batch_records_carry_every_engine_counter():
    """The records' engine structs derive from ``EngineStats``: a new counter needs no pipeline edit."""
    import dataclasses

    from orthrus import EngineStats
    from pipeline.actor.records import BATCH_RECORD, COUNTERS, EngineSnapshot, growth, occupancy_record

    names = [f.name for f in dataclasses.fields(EngineStats)]
    assert COUNTERS.names == [*names, "engine_ms"] and BATCH_RECORD.field("since").type.names == names
    early, late = EngineStats(*range(len(names))), EngineStats(*(2 * i + 1 for i in range(len(names))))
    assert growth(late, early) == late - early and growth(early, late) == EngineStats()   # a reset never goes below 0
    record = occupancy_record(EngineSnapshot(early, 4, 10), EngineSnapshot(late, 4, 30))
    assert pa.array([record], BATCH_RECORD.field("occupancy").type).to_pylist() == [record]


def test_one_function_decides_finish_reason_and_error_together():
    from pipeline.requests.errors import MAX_ERROR_CHARS, finish_columns

    reasons, errors = finish_columns(["stop", "length", None, "stop", "error", None],
                                     [None, None, "prompt is empty", "detokenization failed: X", None, "x" * 900])
    assert reasons == ["stop", "length", "error", "error", "error", "error"]
    assert errors == [None, None, "prompt is empty", "detokenization failed: X", "not decoded", "x" * MAX_ERROR_CHARS]
    assert all((r == "error") == (e is not None) for r, e in zip(reasons, errors))     # consistent by construction
