"""End to end on a real local Ray head (started here, stopped by its own process id).

The head has 4 logical CPUs and 2 logical GPUs (``ray start --num-gpus 2``) on this CPU machine, so
two generation actors each get their own Ray GPU id while running the model on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline.report.startup import CHAIN, INPUT_SIDE
from pipeline.schema import output_schema
from support.job_inputs import MSG_TYPE, write_parquet
from support.paths import REPO
from support.hang import HANG_S
from support.ray_head import WAIT_FOR_BOTH_ACTORS, base_env, part_digests, row_keys, submit, wait_for



def _write_e2e_inputs(d: Path) -> None:
    """Three good shards (no id column: ids derived) and one shard mixing good and bad rows."""
    for s in range(3):
        rows = range(5)
        msgs = [[{"role": "user", "content": f"Complete: def f{s}{i}(x):"}] if i % 2 else None for i in rows]
        extra = {"seed": pa.array([None, 42, None, 7, None], pa.int64())} if s == 0 else \
            {"max_new_tokens": pa.array([3, None, 5, None, None], pa.int64())} if s == 1 else {}
        write_parquet(d / f"shard-{s}.parquet", prompt=[f"def g{s}_{i}(a, b):" for i in rows],
               messages=pa.array(msgs, MSG_TYPE), source=[f"shard-{s}#{i}" for i in rows], **extra)
    long_prompt = "x = 1\n" * 80
    write_parquet(d / "mixed.parquet",
           prompt=["def ok0():", None, None, "def bad_temp():", long_prompt, "def ok1():", "def bad_len():", "ok2"],
           messages=pa.array([None, None, [{"role": "user", "content": None}], None, None, None, None, None],
                             MSG_TYPE),
           temperature=pa.array([None, None, None, -1.0, None, None, None, 0.0]),
           max_new_tokens=pa.array([None, None, None, None, None, None, 0, None], pa.int64()),
           source=[f"mixed#{i}" for i in range(8)])


E2E_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 50, "max_new_tokens": 10, "n": 2, "seed": 123}


@pytest.fixture(scope="module")
def e2e(head, tiny_orthrus_dir, tmp_path_factory):
    """One job submitted with ``ray job submit`` over 4 shards; returns its output and inputs."""
    d = tmp_path_factory.mktemp("e2e")
    _write_e2e_inputs(d / "in")
    cfg = {"input": {"paths": [str(d / "in")]}, "output": {"path": str(d / "out")},
           "model": {"path": str(tiny_orthrus_dir)}, "sampling": E2E_SAMPLING,
           "engine": {"max_batch_size": 4, "batch_size": 4, "max_seq_len": 96}}
    (d / "job.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    proc = submit(head, d / "job.yaml", env_vars=WAIT_FOR_BOTH_ACTORS)
    print(f"ray job submit took {time.time() - t0:.1f}s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Orthrus generation summary" in proc.stdout
    out = pq.read_table(d / "out" / "data")
    inputs = {f.name: pq.read_table(f) for f in sorted((d / "in").iterdir())}
    return {"dir": d, "out": out, "rows": out.to_pylist(), "inputs": inputs, "log": proc.stdout,
            "summary": json.loads((d / "out" / "summary.json").read_text())}


def test_end_to_end_rows_columns_and_stats(e2e):
    out, rows = e2e["out"], e2e["rows"]
    n_in = sum(t.num_rows for t in e2e["inputs"].values())
    assert out.num_rows == n_in * 2 == 46
    assert len({(r["id"], r["sample_index"]) for r in rows}) == 46
    assert out.schema == output_schema([pa.field("source", pa.string())])  # consumed columns are gone
    for r in rows:  # derived ids are '<file name>:<row index>' and match the row they came from
        name, idx = r["id"].split(":")
        assert r["source"] == f"{name.removesuffix('.parquet')}#{idx}"
    ok = [r for r in rows if r["finish_reason"] != "error"]
    assert len(ok) == 30 + 6
    for r in ok:
        hist = r["accept_length_histogram"]
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert len(hist) == 4 and sum(hist) == r["num_cycles"] > 0
        # a greedy row's last blocks may be capped by the tokens left (an AR step when one is left)
        ar_steps = r["num_forward_passes"] - 1 - 2 * r["num_cycles"]
        assert r["num_draft_tokens"] <= 3 * r["num_cycles"] and r["num_draft_tokens"] >= r["num_accepted_draft_tokens"]
        assert ar_steps >= 0 and r["tokens_per_cycle"] == pytest.approx(
            (r["num_accepted_draft_tokens"] + r["num_cycles"] + ar_steps) / (r["num_cycles"] + ar_steps))
        assert sum(L * c for L, c in enumerate(hist)) == r["num_accepted_draft_tokens"]
        assert 1 <= r["num_completion_tokens"] <= 10 and r["time_in_engine_s"] > 0 and r["batch_wall_seconds"] > 0
        assert r["seed"] is not None and r["model"] == e2e["summary"]["config"]["model"]["path"]
    s = e2e["summary"]
    assert s["rows"]["total"] == 46 and s["rows"]["error"] == 10 and s["run"]["complete"]
    assert s["tokens"]["completion"] == sum(r["num_completion_tokens"] for r in ok)
    assert s["speculation"]["cycles"] == sum(r["num_cycles"] for r in ok)
    assert set(s["versions"]) >= {"ray", "torch", "transformers", "python"}
    assert (e2e["dir"] / "out" / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in e2e["log"]  # per-actor throughput log reached the driver


def _expected_prompt(tok, prompt, messages) -> list[int]:
    msgs = messages if messages is not None else [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_completions_equal_direct_engine_output(e2e, tiny_orthrus_dir):
    tok = AutoTokenizer.from_pretrained(tiny_orthrus_dir)
    by_source = {r["source"]: r for t in e2e["inputs"].values() for r in t.to_pylist()}
    ok = [r for r in e2e["rows"] if r["finish_reason"] != "error"]
    prompts, params = [], []
    for r in ok:
        src = by_source[r["source"]]
        prompts.append(_expected_prompt(tok, src["prompt"], src["messages"]))
        assert r["num_prompt_tokens"] == len(prompts[-1])
        temp = src.get("temperature")
        params.append(SamplingParams(temperature=E2E_SAMPLING["temperature"] if temp is None else temp,
                                     top_p=0.95, top_k=50, max_new_tokens=src.get("max_new_tokens") or 10,
                                     seed=r["seed"]))
        if src.get("seed") is not None:  # a row's own seed column wins: seed + sample_index
            assert r["seed"] == src["seed"] + r["sample_index"]
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir), dtype=torch.float32),
                           max_batch_size=4, max_seq_len=96)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the actors (1 CPU each); 2 spinning threads crawl on a busy 2-core box
    try:
        results = engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    for r, p, res in zip(ok, params, results):
        ids = res.token_ids[:-1] if res.finish_reason == "stop" and res.token_ids[-1] in engine.eos_token_ids \
            else res.token_ids
        assert r["completion"] == tok.decode(ids, skip_special_tokens=True)
        assert (r["num_completion_tokens"], r["finish_reason"]) == (len(res.token_ids), res.finish_reason)
        if p.greedy:   # a greedy row's blocks are capped by its batch's budgets: its cycles depend on the batch
            continue
        assert (r["num_cycles"], r["accept_length_histogram"]) == (res.stats.num_cycles,
                                                                   res.stats.accept_length_histogram)
        assert r["num_forward_passes"] == res.stats.num_forward_passes


def test_two_logical_gpus_two_actors_distinct_ids(e2e):
    actors = e2e["summary"]["run"]["actors"]
    assert e2e["summary"]["run"]["placement"]["replicas"] == 2
    assert len(actors) == 2 and all(a["rows"] > 0 for a in actors), (actors, [l for l in e2e["log"].splitlines() if "actor" in l])
    assert sorted(tuple(a["gpu_ids"]) for a in actors) == [(0,), (1,)]
    assert sum(a["rows"] for a in actors) == 46


def test_mixed_good_and_bad_rows_all_come_out(e2e):
    mixed = {int(r["source"].split("#")[1]): r for r in e2e["rows"]
             if r["source"].startswith("mixed") and r["sample_index"] == 0}
    assert len(mixed) == 8 and sum(r["source"].startswith("mixed") for r in e2e["rows"]) == 16
    for i in (0, 5, 7):
        assert mixed[i]["finish_reason"] in ("stop", "length") and mixed[i]["completion"] is not None
    expected = {1: "prompt and messages are both missing",
                2: "messages[0] must have string 'role' and 'content'",
                3: "column 'temperature' must be a finite number >= 0",
                4: "invalid request: prompt has ",
                6: "column 'max_new_tokens' must be an int in [1,"}
    for i, msg in expected.items():
        r = mixed[i]
        assert r["finish_reason"] == "error" and msg in r["error"], r
        assert r["completion"] is None and r["num_completion_tokens"] is None
    assert "context limit max_seq_len=96" in mixed[4]["error"]
    assert e2e["summary"]["error_examples"] and len(e2e["summary"]["error_examples"]) == 5


# ---------------------------------------------------------------- resume after a killed run

def test_resume_after_killed_run_is_complete_without_duplicates(head, tiny_orthrus_dir, tmp_path):
    rows = 12                                       # per file: 24 in all, 8 of them done before the hold
    for s in range(2):
        write_parquet(tmp_path / "in" / f"k{s}.parquet", id=[f"k{s}-{i}" for i in range(rows)],
               prompt=[f"def k{s}_{i}(a):" for i in range(rows)])
    out = tmp_path / "out"
    # a part per batch (part_bytes: 1); the actor runs 4 batches, then holds the rest at a barrier
    # never released (hold_after:4:FILE), so the kill finds 2 to 4 parts and 16 of 24 rows unfinished
    # however fast or loaded the machine (Ray Data may hold a finished block back from the driver)
    cfg = {"input": {"paths": [str(tmp_path / "in")]},
           "output": {"path": str(out), "part_seconds": 0.5, "part_bytes": 1},
           "model": {"path": str(tiny_orthrus_dir)}, "prompt": {"chat_template": "off"},
           "sampling": {"max_new_tokens": 16},
           "engine": {"batch_size": 2, "max_batch_size": 2, "speculative": False}, "resources": {"replicas": 1}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / "job.yaml")]
    with open(tmp_path / "killed.log", "wb") as log:  # first run: driver on the test head, killed mid-run
        driver = subprocess.Popen(cmd, cwd=REPO, env={**base_env(), "RAY_ADDRESS": head["gcs"],
                                                      "ORTHRUS_FAULT_INJECT": f"hold_after:4:{tmp_path / 'never'}"},
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: len(part_digests(out)) >= 2 or driver.poll() is not None, "two committed parts")
        finally:
            driver.kill()  # SIGKILL by its own pid: no cleanup code runs
            driver.wait()
    before = part_digests(out)
    done = row_keys(out / "data" / name for name in before)
    assert 0 < len(done) < 2 * rows, f"the run was not killed mid-way ({len(done)} rows committed)"

    # Second run: --resume on an embedded local Ray (no cluster address): one CPU actor.
    began = time.time()
    # beside two CPU burners this resume once outran a 300 s bound with 40 rows of 48 tokens left
    # (2026-12-07); now 16 rows of 16 tokens, and the bound only stops a hung run
    proc = subprocess.run([*cmd, "--resume"], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=HANG_S)
    wall = time.time() - began
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "took over the stale lease of run" in proc.stdout              # the killed driver's lease
    after = part_digests(out)
    assert all(after[name] == digest for name, digest in before.items())  # finished parts untouched
    new = row_keys(out / "data" / name for name in after if name not in before)
    assert not set(new) & set(done)                                        # finished rows not recomputed
    assert sorted(done + new) == sorted((f"k{s}-{i}", 0) for s in range(2) for i in range(rows))
    summary = json.loads((out / "summary.json").read_text())["run"]
    assert (summary["mode"], summary["rows_skipped_as_finished"], summary["rows_generated"]) == \
        ("local", len(done), 2 * rows - len(done))
    assert summary["placement"] == {"replicas": 1, "gpus_per_replica": 0.0, "cpus_per_replica": 1.0}
    assert summary["startup_seconds"] > 0
    # The start-up split: every phase known and >= 0; the actor's chain adds up to its total (within
    # rounding), which lies within the command's wall time; the input side ran beside that chain.
    split = summary["startup"]
    assert all(isinstance(split[k], (int, float)) and split[k] >= 0 for k in (*CHAIN, *INPUT_SIDE, "total_s")), split
    assert sum(split[k] for k in CHAIN) - 0.01 <= split["total_s"] <= wall
    assert sum(split[k] for k in INPUT_SIDE) <= split["total_s"] - split["before_ray_s"] - split["ray_start_s"] + 0.01
    assert "start-up split before Ray" in proc.stdout
    assert summary["complete"] and not list((out / "_tmp").glob("*.inprogress"))


# ---------------------------------------------------------------- an actor dying mid-batch

class _DiesOnce:
    """Mixin: the first call anywhere kills its actor process after decoding, before returning."""

    marker: Path

    async def __call__(self, batch):
        result = await super().__call__(batch)
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)
        return result


def test_actor_death_is_retried_without_duplicates(head, tiny_orthrus_dir, tmp_path, monkeypatch):
    import ray
    from ray import cloudpickle

    from pipeline.config_file import load_config
    from pipeline.run.job import preflight, run
    from pipeline.actor.stage import GenerationStage

    write_parquet(tmp_path / "in" / "a.parquet", id=[f"a{i}" for i in range(8)], prompt=[f"def a{i}():" for i in range(8)])
    cfg = load_config(None, data={"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "o")},
                                  "model": {"path": str(tiny_orthrus_dir)}, "sampling": {"max_new_tokens": 6},
                                  "engine": {"batch_size": 2}, "resources": {"replicas": 1}})
    stage = type("DyingStage", (_DiesOnce, GenerationStage), {"marker": tmp_path / "died"})
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address=head["gcs"], logging_level="WARNING")
    try:
        summary = run(preflight(cfg), "cluster", stage_cls=stage)
    finally:
        ray.shutdown()
    assert (tmp_path / "died").exists()  # an actor really died mid-run
    keys = row_keys((tmp_path / "o" / "data").glob("*.parquet"))
    assert sorted(keys) == sorted((f"a{i}", 0) for i in range(8)) and summary["run"]["complete"]
