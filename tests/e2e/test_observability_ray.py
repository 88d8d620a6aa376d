"""Watching and bounding a run end to end on a real local Ray head (one head for the module).

- a job submitted with ``ray job submit``: the lossless audit (float32: every audited row equals
  plain AR), per-row times, the cost section, the prefill counts (prompts shared by two rows are
  prefix-cache hits), the progress lines, and the actors' live metrics read back from the node's
  Prometheus endpoint;
- one output through four runs: ``behaviour.row_timeout_s`` (rows that run too long become error
  rows, rows in == rows out), ``--retry-errors`` stopped by ``behaviour.max_wall_seconds`` (a clean
  stop: exit 1, complete parts, a hint), ``--resume`` finishing it exactly once, and the completion
  marker ``_SUCCESS`` written, removed and written again through them; a terminal free of Ray's notices.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.actor.audit import is_audited
from support.job_inputs import write_parquet
from support.paths import REPO, VENV_BIN
from support.hang import HANG_S
from support.ray_head import base_env, part_digests, row_keys

BUNDLED = REPO / "models" / "tiny-orthrus-py"
SAMPLE = re.compile(r'^(ray_orthrus_\w+)\{(.*)\} (\S+)$')


def _config(tmp_path: Path, model: Path, **sections) -> Path:
    cfg = {"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out")},
           "model": {"path": str(model)}, "prompt": {"chat_template": "off"}}
    cfg.update(sections)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(url: str) -> dict[str, dict[str, float]]:
    """``ray_orthrus_*`` samples summed over workers: name -> {label of interest: value}."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[m.group(1)][labels.get("status") or labels.get("result") or ""] += float(m.group(3))
    return out


def _wait_for_metrics(url: str, done, timeout: float = HANG_S) -> dict:   # exports are periodic; a loaded node lags
    deadline = time.time() + timeout
    while True:
        got = _metrics(url)
        if done(got) or time.time() > deadline:
            return got
        time.sleep(1)


def test_audit_times_cost_progress_and_live_metrics_on_a_real_head(head, tmp_path):
    ids = [f"row-{i}" for i in range(24)]
    for s in range(2):       # each shard's rows in pairs sharing a prompt: the second one's is a prefix-cache hit
        write_parquet(tmp_path / "in" / f"s{s}.parquet", id=ids[s::2], prompt=[f"def f{s}_{k // 2}(x, y):" for k in range(12)])
    job = _config(tmp_path, BUNDLED, sampling={"max_new_tokens": 24, "stop": ["\ndef "]},
                  engine={"batch_size": 4, "max_batch_size": 4}, audit={"fraction": 0.5})
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", head["dashboard"], "--working-dir", str(REPO),
           "--runtime-env-json", json.dumps({"env_vars": {"RAY_AUTH_MODE": "disabled"}}), "--",
           "python", "-m", "jobs.generate", "--config", str(job)]
    proc = subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = tmp_path / "out"
    rows = pq.read_table(out / "data").to_pylist()
    summary = json.loads((out / "summary.json").read_text())
    audited = [r for r in rows if is_audited(r["id"], 0.5)]

    # the audit: the same rows a rerun would pick, every one equal to plain AR (float32 on CPU)
    assert 4 <= len(audited) <= 20 and all(r["audit_match"] is True for r in audited)
    assert all(r["audit_match"] is None for r in rows if r not in audited)
    assert (summary["audit"]["rows_audited"], summary["audit"]["exact_matches"]) == (len(audited), len(audited))
    assert f"audit          {len(audited)} greedy rows re-decoded with plain AR: {len(audited)} exact" in proc.stdout

    # per-row times: inside the batch's wall time
    for r in rows:
        assert 0 < r["time_in_engine_s"] and 0 <= r["time_waiting_s"]
        assert r["time_in_engine_s"] + r["time_waiting_s"] <= r["batch_wall_seconds"] + 1e-6
    assert summary["row_seconds"]["time_in_engine_s"]["max"] == pytest.approx(max(r["time_in_engine_s"] for r in rows),
                                                                             abs=1e-3)

    # cost: two actors on the head's two logical GPUs, held for the run's wall time
    cost, run = summary["run"]["cost"], summary["run"]
    assert cost["device"] == "gpu" and cost["device_seconds_reserved"] == pytest.approx(2 * run["wall_seconds"], 0.01)
    assert 0 < cost["device_seconds_busy"] <= cost["device_seconds_reserved"]
    assert cost["tokens_per_device_hour"] == pytest.approx(
        run["completion_tokens"] / cost["device_seconds_reserved"] * 3600, rel=0.01)

    # prefill: each row's prompt tokens computed or copied from a slot holding them, once (no retries here)
    prefill = summary["prefill"]
    computed, hits = prefill["computed_tokens"], prefill["prefix_cache_hit_tokens"]
    assert computed > 0 and hits > 0 and computed + hits == sum(r["num_prompt_tokens"] for r in rows)
    assert prefill["prefix_cache_hit_rate"] == pytest.approx(hits / (computed + hits))
    assert f"prefill        {computed:,} prompt tokens computed, {hits:,} shared by the prefix cache" in proc.stdout

    # the paged KV cache: each engine's pool (4 slots at full length by default on CPU), pages held, rows in flight
    kv = summary["kv_cache"]
    assert kv["page_size"] == 16 and kv["pages"] % 4 == 0 and 0 < kv["pages_in_use_peak"] <= kv["pages"]
    assert 0 < kv["pages_in_use_mean"] <= kv["pages_in_use_peak"] and 0 < kv["rows_in_flight_mean"] <= 4
    assert kv["preemptions"] == 0 and kv["recomputed_tokens"] == 0
    assert f"peak {kv['pages_in_use_peak']:,} of {kv['pages']:,} (16 tokens each)" in proc.stdout

    # one progress display: our lines, no Ray Data operator bars
    assert "[orthrus] progress 24/24 rows (100.0%)" in proc.stdout

    # live metrics, read back from the node's Prometheus endpoint
    tokens = sum(r["num_completion_tokens"] for r in rows)
    got = _wait_for_metrics(head["metrics"], lambda m: m["ray_orthrus_rows_total"]["ok"] >= 24
                            and m["ray_orthrus_completion_tokens_total"][""] >= tokens
                            and m["ray_orthrus_prefill_tokens_total"][""] >= computed
                            and m["ray_orthrus_prefix_cache_hit_tokens_total"][""] >= hits
                            # gauges are exported apart from the counters: wait for both actors' too
                            and m["ray_orthrus_tokens_per_cycle"][""] >= 2.0
                            and m["ray_orthrus_kv_pages_peak"][""] > 0)
    assert got["ray_orthrus_rows_total"]["ok"] == 24 and got["ray_orthrus_rows_total"].get("error", 0) == 0
    assert got["ray_orthrus_completion_tokens_total"][""] == tokens
    assert got["ray_orthrus_audit_rows_total"]["match"] == len(audited)
    assert got["ray_orthrus_accepted_draft_tokens_total"][""] == summary["speculation"]["accepted_draft_tokens"]
    assert got["ray_orthrus_verified_draft_tokens_total"][""] == summary["speculation"]["verified_draft_tokens"]
    assert 1.0 <= got["ray_orthrus_tokens_per_cycle"][""] / 2 <= 8.0    # two actors' gauges, summed
    assert 0 < got["ray_orthrus_slot_occupancy"][""] <= 2.0
    assert got["ray_orthrus_prefill_tokens_total"][""] == computed
    assert got["ray_orthrus_prefix_cache_hit_tokens_total"][""] == hits
    assert 0 < got["ray_orthrus_prefix_cache_hit_rate"][""] <= 2.0     # two actors' gauges, summed
    assert 0 < got["ray_orthrus_kv_pages_peak"][""] <= 2 * kv["pages_in_use_peak"]
    assert "ray_orthrus_kv_pages_in_use" in got


def _generate_quietly(job: Path, env: dict, *args: str, hold_after: int | None = None,
                      status: int = 0) -> subprocess.CompletedProcess:
    """``python -m jobs.generate`` on the module's head; its exit ``status`` and a terminal free of
    Ray's notices and colour codes. ``hold_after``: each actor then holds every later batch at a
    barrier that is never released (a device that stalls)."""
    never = job.parent / "never"
    held = {"ORTHRUS_FAULT_INJECT": f"hold_after:{hold_after}:{never}"} if hold_after is not None else {}
    proc = subprocess.run([sys.executable, "-m", "jobs.generate", "--config", str(job), *args], cwd=REPO,
                          env={**env, **held}, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == status, proc.stdout[-4000:] + proc.stderr[-4000:]
    for notice in ("core_worker.cc", "Progress bars disabled", "Starting execution of Dataset"):
        assert notice not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    assert "\x1b[" not in proc.stdout + proc.stderr      # no colour codes in a pipe (Ray's actor prefixes)
    return proc


def _assert_a_clean_stop(proc: subprocess.CompletedProcess, out: Path, keys: list, took: float) -> None:
    """A run stopped by ``max_wall_seconds=20``: exit 1 (checked by the caller), the hint, no
    traceback, complete parts holding each key at most once, and no marker."""
    assert "behaviour.max_wall_seconds=20 reached" in proc.stdout and "rerun with --resume" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]   # a clean stop
    # the stalled batch never ends (a barrier), so a driver that waited for it would never end: the
    # guard stopped it, whatever the time it took to get there (no bound on ``took``: no race)
    summary = json.loads((out / "summary.json").read_text())
    done = row_keys(out / "data" / name for name in part_digests(out))
    assert summary["run"]["stopped_by"] == "max_wall_seconds" and not summary["run"]["complete"]
    assert len(done) == len(set(done)) < len(keys) and summary["rows"]["total"] == len(done)
    assert not (out / "_SUCCESS").exists()
    print(f"max_wall_seconds=20: the driver stopped after {took:.1f} s with {len(done)}/{len(keys)} rows committed")


def test_row_timeout_wall_clock_stop_resume_and_the_success_marker(head, tiny_orthrus_dir, tmp_path):
    """One output through four runs (two tests before this one ran steps 1-3 each, on outputs of their own):

    1. every row outlives a 1 ms row timeout: all error rows, none lost, the job finishes, and the
       output is complete, so ``_SUCCESS`` is written with the run's figures;
    2. ``--retry-errors`` takes the error rows out of ``data/`` and runs on a device that stalls after
       two batches (a barrier never released, so only the guard can end it, however fast or loaded
       the machine) under ``max_wall_seconds``: a clean stop with complete parts and no marker;
    3. ``--resume`` generates the rest: every row exactly once, none an error, the resume's marker;
    4. a new input file and a ``--resume`` stopped before it commits anything: the old marker is gone
       (only its removal at the run's start can explain that)."""
    keys = []
    for s in range(2):
        ids = [f"s{s}-{i}" for i in range(12)]
        write_parquet(tmp_path / "in" / f"s{s}.parquet", id=ids, prompt=[f"def f{s}_{i}(a):" for i in range(12)])
        keys += [(i, 0) for i in ids]
    env = {**base_env(), "RAY_ADDRESS": head["gcs"]}
    job = _config(tmp_path, tiny_orthrus_dir, sampling={"max_new_tokens": 8},
                  engine={"batch_size": 2, "max_batch_size": 2, "max_concurrent_batches": 1}, resources={"replicas": 1})
    out, marker = tmp_path / "out", tmp_path / "out" / "_SUCCESS"

    # 1. a 1 ms row timeout, checked every step at that limit: no row's prefill and 8 tokens fit in it
    _generate_quietly(job, env, "--set", "behaviour.row_timeout_s=0.001")
    rows = pq.read_table(out / "data").to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows) == sorted(keys)
    assert all(r["finish_reason"] == "error" and "row timeout: aborted after" in r["error"] for r in rows)
    run, record = json.loads((out / "summary.json").read_text())["run"], json.loads(marker.read_text())
    assert run["complete"] and record["run_id"] == run["run_id"]
    assert (record["rows"]["expected"], record["rows"]["in_output"], record["rows"]["error"]) == (24, 24, 24)

    # 2. --retry-errors on a device that stalls after two batches, under a wall-clock limit
    t0 = time.time()
    proc = _generate_quietly(job, env, "--retry-errors", "--set", "behaviour.max_wall_seconds=20", hold_after=2, status=1)
    _assert_a_clean_stop(proc, out, keys, time.time() - t0)

    # 3. --resume finishes it: every row exactly once, none an error, the resume's marker
    _generate_quietly(job, env, "--resume")
    rows = pq.read_table(out / "data").to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows) == sorted(keys)
    assert all(r["finish_reason"] != "error" for r in rows)
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["complete"] and json.loads(marker.read_text())["run_id"] == run["run_id"]

    # 4. a new input file, --resume stopped before it commits anything: the old marker is gone
    write_parquet(tmp_path / "in" / "s2.parquet", id=[f"s2-{i}" for i in range(6)], prompt=[f"def g{i}(a):" for i in range(6)])
    _generate_quietly(job, env, "--resume", "--set", "behaviour.max_wall_seconds=2", hold_after=0, status=1)
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["stopped_by"] == "max_wall_seconds" and not run["complete"] and not marker.exists()
