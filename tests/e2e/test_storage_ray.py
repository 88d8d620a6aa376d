"""Inputs, model and output on an S3 endpoint, end to end through a real local Ray head and
``ray job submit`` (moto's server on loopback; the job uses only pyarrow's S3 client):

- the same greedy job on local disk and on S3 gives identical rows and completions (derived ids too),
  and both end with the completion marker ``_SUCCESS``;
- an actor SIGKILLed, then the driver, then ``--resume``: every row exactly once, parts untouched;
- ``--retry-errors`` and the config-change refusal on an S3 output.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.local_s3 import CLIENT_ENV, moto_server, s3fs, upload
from support.ray_head import generation_actor, kill_pid, submit, wait_for



@pytest.fixture(scope="module")
def s3(tiny_orthrus_dir):
    """A moto server with bucket ``bkt`` holding the test model under ``models/tiny``."""
    with moto_server() as endpoint:
        fs = s3fs(endpoint)
        fs.create_dir("bkt")
        upload(fs, tiny_orthrus_dir, "bkt/models/tiny")
        yield {"endpoint": endpoint, "fs": fs}


def _job(tmp_path: Path, name: str, inputs: str, output: str, model: str, endpoint: str, **sections) -> Path:
    cfg = {"input": {"paths": [inputs]}, "output": {"path": output, "part_bytes": 1}, "model": {"path": model},
           "resources": {"replicas": 1}, "storage": {"endpoint": endpoint, "model_cache_dir": str(tmp_path / "cache")},
           "prompt": {"chat_template": "off"}, **sections}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _s3_parts(fs, prefix: str) -> dict[str, str]:
    found = fs.get_file_info(pafs.FileSelector(f"{prefix}/data", allow_not_found=True))
    parts = {}
    for f in sorted(found, key=lambda f: f.path):
        if f.base_name.endswith(".parquet"):
            with fs.open_input_stream(f.path) as src:
                parts[f.base_name] = hashlib.sha256(src.read()).hexdigest()
    return parts


def _s3_rows(fs, prefix: str, names=None) -> list[dict]:
    names = names if names is not None else list(_s3_parts(fs, prefix))
    return [r for n in names for r in pq.read_table(f"{prefix}/data/{n}", filesystem=fs).to_pylist()]


def _shards(local: Path, fs, prefix: str, n: int, rows: int, ids: bool = True) -> list[tuple[str, int]]:
    local.mkdir(parents=True)
    for s in range(n):
        cols = {"prompt": [f"def s{s}_{i}(a):" for i in range(rows)]}
        table = pa.table({"id": [f"s{s}-{i}" for i in range(rows)], **cols} if ids else cols)
        pq.write_table(table, local / f"s{s}.parquet")
    upload(fs, local, prefix)
    return sorted((f"s{s}-{i}", 0) for s in range(n) for i in range(rows))


# Not the cycle statistics: a greedy iteration's block is capped by the largest budget left in its
# batch, so how a greedy row's tokens split into cycles depends on how the two runs happened to batch
# (its tokens do not).
_COMPARED = ["id", "sample_index", "completion", "finish_reason", "error", "num_prompt_tokens",
             "num_completion_tokens", "seed"]


def test_same_greedy_job_on_local_disk_and_on_s3_gives_identical_rows(head, s3, tiny_orthrus_dir, tmp_path):
    _shards(tmp_path / "in", s3["fs"], "bkt/same/in", 2, 12, ids=False)   # derived ids: '<file>:<row>'
    sections = {"sampling": {"max_new_tokens": 12, "stop": ["\n\n"]}, "engine": {"batch_size": 4}}
    local = _job(tmp_path, "local", str(tmp_path / "in"), str(tmp_path / "out"), str(tiny_orthrus_dir),
                 s3["endpoint"], **sections)
    remote = _job(tmp_path, "remote", "s3://bkt/same/in/", "s3://bkt/same/out", "s3://bkt/models/tiny",
                  s3["endpoint"], **sections)
    for job in (local, remote):
        proc = submit(head, job, env_vars=CLIENT_ENV)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    key = lambda r: (r["id"], r["sample_index"])  # noqa: E731
    on_disk = sorted(pq.read_table(tmp_path / "out" / "data", columns=_COMPARED).to_pylist(), key=key)
    on_s3 = sorted(({c: r[c] for c in _COMPARED} for r in _s3_rows(s3["fs"], "bkt/same/out")), key=key)
    assert len(on_disk) == 24 and on_s3 == on_disk
    assert {r["id"] for r in on_s3} == {f"s{s}.parquet:{i}" for s in range(2) for i in range(12)}
    with s3["fs"].open_input_stream("bkt/same/out/summary.json") as f:
        summary = json.loads(f.read())
    assert summary["run"]["complete"]
    with s3["fs"].open_input_stream("bkt/same/out/_SUCCESS") as f:     # the completion marker, on S3 too
        assert json.loads(f.read())["run_id"] == summary["run"]["run_id"]
    local_run = json.loads((tmp_path / "out" / "summary.json").read_text())["run"]
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["rows"]["in_output"] == local_run["rows_expected"]
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").glob("tiny-*/model.safetensors"))


def test_actor_and_driver_sigkill_on_s3_then_resume_exactly_once(head, s3, tmp_path, monkeypatch):
    from ray.job_submission import JobStatus, JobSubmissionClient

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    fs, out = s3["fs"], "bkt/kill/out"
    everything = _shards(tmp_path / "in", fs, "bkt/kill/in", 2, 20)
    job = _job(tmp_path, "kill", "s3://bkt/kill/in", f"s3://{out}", "s3://bkt/models/tiny", s3["endpoint"],
               sampling={"max_new_tokens": 40}, engine={"batch_size": 2, "max_batch_size": 2, "speculative": False})
    sid = f"s3-faults-{os.getpid()}-{int(time.time())}"
    assert submit(head, job, wait=False, sid=sid, env_vars=CLIENT_ENV).returncode == 0
    client = JobSubmissionClient(head["dashboard"])
    job_id = wait_for(lambda: client.get_job_info(sid).job_id, "the driver to start")
    actor = wait_for(lambda: len(_s3_parts(fs, out)) >= 1 and generation_actor(head, job_id), "a committed part")
    kill_pid(actor)                                                          # mid-run, mid-batch
    at_actor_kill = len(_s3_parts(fs, out))
    wait_for(lambda: generation_actor(head, job_id) not in (0, actor), "Ray to restart the actor")
    wait_for(lambda: len(_s3_parts(fs, out)) >= at_actor_kill + 2, "progress after the actor restart")
    kill_pid(int(client.get_job_info(sid).driver_info.pid))               # then the driver
    assert wait_for(lambda: client.get_job_status(sid) in (JobStatus.FAILED, JobStatus.STOPPED), "job end")
    before = _s3_parts(fs, out)
    done = [(r["id"], r["sample_index"]) for r in _s3_rows(fs, out)]
    print(f"parts: {at_actor_kill} at the actor kill, {len(before)} at the driver kill ({len(done)} rows)")
    assert len(done) == len(set(done)) and at_actor_kill < len(before) and 0 < len(done) < len(everything)

    resumed = submit(head, job, "--resume", env_vars=CLIENT_ENV)      # the dead driver's lease is taken over
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "took over the stale lease" in resumed.stdout
    after = _s3_parts(fs, out)
    assert all(after[name] == digest for name, digest in before.items())  # committed parts untouched
    new = [(r["id"], r["sample_index"]) for r in _s3_rows(fs, out, [n for n in after if n not in before])]
    assert not set(new) & set(done) and sorted(done + new) == everything  # nothing finished redone
    with fs.open_input_stream(f"{out}/summary.json") as f:
        run = json.loads(f.read())["run"]
    assert run["complete"] and (run["rows_skipped_as_finished"], run["rows_generated"]) == \
        (len(done), len(everything) - len(done))
    leases = fs.get_file_info(pafs.FileSelector(f"{out}/_leases", allow_not_found=True))
    assert not [f for f in leases if f.type == pafs.FileType.File]      # released at the end


def test_retry_errors_and_the_config_change_refusal_on_s3(head, s3, tmp_path):
    fs, out = s3["fs"], "bkt/retry/out"
    _shards(tmp_path / "in", fs, "bkt/retry/in", 1, 6)
    job = _job(tmp_path, "retry", "s3://bkt/retry/in", f"s3://{out}", "s3://bkt/models/tiny", s3["endpoint"],
               sampling={"max_new_tokens": 4}, engine={"batch_size": 3})
    # A row over the context limit is an error row; with a longer limit the retry generates it.
    long_row = tmp_path / "long"
    long_row.mkdir()
    pq.write_table(pa.table({"id": ["long"], "prompt": ["x = 1\n" * 60]}), long_row / "long.parquet")
    upload(fs, long_row, "bkt/retry/in")
    proc = submit(head, job, "--set", "engine.max_seq_len=64", env_vars=CLIENT_ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["id"]: r for r in _s3_rows(fs, out)}
    assert len(rows) == 7 and rows["long"]["finish_reason"] == "error"

    changed = submit(head, job, "--resume", "--set", "sampling.temperature=0.5", "--set", "engine.max_seq_len=64",
                     env_vars=CLIENT_ENV)
    assert changed.returncode != 0                     # `ray job submit` exits 1 for any failed job (ours: 2)
    assert "Changed: sampling.temperature: 0.0 -> 0.5" in changed.stdout + changed.stderr

    proc = submit(head, job, "--retry-errors", "--allow-config-change", env_vars=CLIENT_ENV)  # max_seq_len back
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--retry-errors: 1 error row(s) moved to s3://bkt/retry/out/retried" in proc.stdout
    after = _s3_rows(fs, out)
    assert sorted(r["id"] for r in after) == sorted(rows) and all(r["finish_reason"] != "error" for r in after)
    assert {r["id"]: r["completion"] for r in after if r["id"] != "long"} == \
        {i: r["completion"] for i, r in rows.items() if i != "long"}               # the others untouched
    retried = [f for f in fs.get_file_info(pafs.FileSelector(f"{out}/retried")) if f.type == pafs.FileType.File]
    assert [r["id"] for f in retried for r in pq.read_table(f.path, filesystem=fs).to_pylist()] == ["long"]
