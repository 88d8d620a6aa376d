"""Hostile rows, unusual columns, a second job, duplicates and a crash, through the real job on a real
local Ray head (one head for the module; each job's driver is ``python -m jobs.generate``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support.hostile import hostile_rows
from support.job_inputs import tree_snapshot
from support.paths import REPO
from support.hang import HANG_S
from support.ray_head import base_env, row_keys, wait_for



def _job(tmp_path: Path, model: Path, **sections) -> Path:
    cfg = {"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out")},
           "model": {"path": str(model)}, "resources": {"replicas": 1}, **sections}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _generate(head, job: Path, *args: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "jobs.generate", "--config", str(job), *args]
    full_env = {**base_env(), "RAY_ADDRESS": head["gcs"], **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=HANG_S)


def test_hostile_rows_view_types_and_hive_partitions_end_to_end(head, tiny_orthrus_dir, tmp_path):
    table, expected = hostile_rows()
    part = tmp_path / "in" / "lang=py" / "hostile.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(table.append_column("tag", pa.array([f"t{i}" for i in range(table.num_rows)], pa.string_view()))
                        .append_column("nums", pa.array([[i] for i in range(table.num_rows)], pa.list_view(pa.int32()))),
                   part)
    before = tree_snapshot(tmp_path / "in")
    job = _job(tmp_path, tiny_orthrus_dir, sampling={"max_new_tokens": 4, "n": 2},
               engine={"batch_size": 4, "max_batch_size": 4, "max_seq_len": 128})
    proc = _generate(head, job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows) == sorted((i, s) for i in expected for s in (0, 1))
    for r in rows:
        want = expected[r["id"]]
        assert (r["error"] is None) if want is None else (want in r["error"]), (r["id"], r["error"])
        i = table["id"].to_pylist().index(r["id"])
        assert (r["lang"], r["tag"], r["nums"]) == ("py", f"t{i}", [i])      # partition and view columns kept
    assert tree_snapshot(tmp_path / "in") == before                                   # inputs unchanged


def test_one_writer_per_output_dir_and_the_dedupe_repair(head, tiny_orthrus_dir, tmp_path):
    ids = [f"r{i}" for i in range(12)]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ids, "prompt": [f"def f{i}():" for i in range(12)]}), tmp_path / "in" / "a.parquet")
    job = _job(tmp_path, tiny_orthrus_dir, sampling={"max_new_tokens": 4},
               engine={"batch_size": 2, "max_batch_size": 2, "max_concurrent_batches": 1})
    # The first job holds its batches until the test creates ``gate`` (a barrier, not a sleep): it is
    # still running, holding the lease, whatever the machine's load, until both refusals are seen.
    gate = tmp_path / "gate"
    first = _generate(head, job, env={"ORTHRUS_FAULT_INJECT": f"hold_after:0:{gate}"}, wait=False)
    try:
        lease = tmp_path / "out" / "_lease.json"
        wait_for(lambda: lease.exists() or first.poll() is not None, "the first job's lease")
        assert first.poll() is None, first.communicate()[1][-3000:]
        holder = json.loads(lease.read_text())
        for flag in ("--resume", "--overwrite"):        # a second job is refused, naming the first; had it
            second = _generate(head, job, flag)        # waited for the lease it would never end (the first is held)
            assert second.returncode == 2, f"not refused: {second.stdout[-1500:]}{second.stderr[-1500:]}"
            assert f"is in use by another job: run {holder['run_id']} (pid {first.pid} on " in second.stderr
    finally:
        gate.touch()                                   # release the first job (also when the test fails)
    out, err = first.communicate(timeout=HANG_S)
    assert first.returncode == 0, out[-3000:] + err[-3000:]
    assert not lease.exists() and sorted(k for k, _ in row_keys((tmp_path / "out" / "data").glob("*.parquet"))) == \
        sorted(ids)

    # a directory that holds duplicates (as two writers would leave it): refused, then repaired
    parts = sorted((tmp_path / "out" / "data").glob("part-*.parquet"))
    shutil.copy(parts[0], parts[0].with_name(parts[0].name.replace("-000000.", "-999999.")))
    proc = _generate(head, job, "--resume")
    assert proc.returncode == 2 and "duplicate (id, sample_index) row(s)" in proc.stderr and "--dedupe" in proc.stderr
    proc = _generate(head, job, "--dedupe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    copied = pq.read_metadata(parts[0]).num_rows
    assert f"--dedupe: removed {copied} duplicate row(s)" in proc.stdout
    keys = row_keys((tmp_path / "out" / "data").glob("*.parquet"))
    assert sorted(k for k, _ in keys) == sorted(ids)


def test_a_crash_exits_4_with_one_paragraph_and_the_traceback_in_a_file(head, tiny_orthrus_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_orthrus_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["a"], "prompt": ["def a():"]}), tmp_path / "in" / "a.parquet")
    proc = _generate(head, _job(tmp_path, model, sampling={"max_new_tokens": 4}))
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    paragraph = [line for line in proc.stderr.splitlines() if line.startswith("error: the job crashed: ")]
    assert len(paragraph) == 1 and "rerun with --resume" in paragraph[0]
    last = paragraph[0]
    logs = list((tmp_path / "out" / "_logs").glob("crash-*.log"))
    assert len(logs) == 1 and f"Full traceback: {logs[0]}" in last and "Traceback" in logs[0].read_text()
    assert not (tmp_path / "out" / "_lease.json").exists()                    # released on the way out


def test_retry_errors_and_the_config_change_refusal_end_to_end(head, tiny_orthrus_dir, tmp_path):
    ids = [f"r{i}" for i in range(6)]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ids, "prompt": [f"def f{i}():" for i in range(6)]}), tmp_path / "in" / "a.parquet")
    job = _job(tmp_path, tiny_orthrus_dir, sampling={"max_new_tokens": 4}, engine={"batch_size": 3})
    proc = _generate(head, job, env={"ORTHRUS_FAULT_INJECT": "oom_on_id:r4"})   # r4 fails even alone: an error row
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = {r["id"]: r for r in pq.read_table(out / "data").to_pylist()}
    assert rows["r4"]["finish_reason"] == "error" and len(rows) == 6

    changed = _generate(head, job, "--resume", "--set", "sampling.temperature=0.5")
    assert changed.returncode == 2 and "Changed: sampling.temperature: 0.0 -> 0.5" in changed.stderr

    proc = _generate(head, job, "--retry-errors")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--retry-errors: 1 error row(s) moved to" in proc.stdout
    after = pq.read_table(out / "data").to_pylist()
    assert sorted(r["id"] for r in after) == ids and all(r["finish_reason"] != "error" for r in after)
    assert {r["id"]: r["completion"] for r in after if r["id"] != "r4"} == \
        {i: r["completion"] for i, r in rows.items() if i != "r4"}               # the others untouched
    assert [r["id"] for r in pq.read_table(out / "retried").to_pylist()] == ["r4"]

    allowed = _generate(head, job, "--allow-config-change", "--set", "sampling.temperature=0.5")
    assert allowed.returncode == 0, allowed.stdout[-3000:] + allowed.stderr[-3000:]
