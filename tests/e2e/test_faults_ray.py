"""Faults and bad inputs end to end on a real local Ray head (one head for the module, stopped by its pid).

- a job over shards full of bad rows, differing schemas and an empty shard, with simulated
  out-of-memory on the actors: every row comes out exactly once, nothing is written outside the
  output dir;
- an actor SIGKILLed mid-run, then the driver SIGKILLed, then the job re-submitted with --resume;
- the output disk filling up mid-run: a clear error, only complete parts, then resume.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support.job_inputs import MSG, mounted, raw_strings, tree_snapshot
from support.ray_head import generation_actor, kill_pid, part_digests, row_keys, submit, wait_for

PART_NAME = re.compile(r"part-\d{8}-\d{6}-[0-9a-f]{6}-\d{6}\.parquet")
LAYOUT = {"data", "_tmp", "_job.json", "summary.json", "summary.png"}     # a run that stopped early
COMPLETE = LAYOUT | {"_SUCCESS"}                                          # a complete one


def _job(tmp_path: Path, model: Path, **sections) -> Path:
    # a part per batch (not one at the 60 s default), so a kill mid-run finds some committed
    cfg = {"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out"), "part_bytes": 1},
           "model": {"path": str(model)}, "resources": {"replicas": 1}}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _shards(d: Path, n: int, rows: int) -> list[tuple[str, int]]:
    d.mkdir(parents=True)
    for s in range(n):
        pq.write_table(pa.table({"id": [f"s{s}-{i}" for i in range(rows)],
                                 "prompt": [f"def s{s}_{i}(a):" for i in range(rows)]}), d / f"s{s}.parquet")
    return sorted((f"s{s}-{i}", 0) for s in range(n) for i in range(rows))


# ---------------------------------------------------------------- bad inputs + simulated OOM, end to end

PATH_IDS = ["../../../etc/passwd", "/abs/evil", "a/b\\c", "nul\x00id", "oom-row"]


def _bad_input_shards(d: Path) -> dict[str, str | None]:
    """Four shards with differing schemas (one empty); returns id -> expected error substring."""
    d.mkdir()
    a = {"id": ["ok-a", "null", "empty", "blank", "utf8", "ctrl", "long", "temp", "top_p", "top_k", "max0",
                "maxbig", *PATH_IDS]}
    n = len(a["id"])
    prompts = [b"def a():", None, b"", b" \n\t", b"def \xff():", b"def c():\x00\x1b\x07", b"x = 1\n" * 40]
    a["prompt"] = raw_strings(prompts + [b"def p():"] * (n - len(prompts)))
    over = {"temp": ("temperature", -1.0), "top_p": ("top_p", 1.5), "top_k": ("top_k", -1),
            "max0": ("max_new_tokens", 0), "maxbig": ("max_new_tokens", 10 ** 9)}
    for col, typ in (("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int64()),
                     ("max_new_tokens", pa.int64())):
        a[col] = pa.array([over[i][1] if i in over and over[i][0] == col else None for i in a["id"]], typ)
    a["score"] = pa.array(range(n), pa.int32())
    pq.write_table(pa.table(a), d / "a.parquet")
    b_msgs = [MSG % "hi", "{not json", "[]", MSG % "\\ud800"]
    pq.write_table(pa.table({"id": ["ok-b", "msg-json", "msg-empty", "msg-surrogate"], "messages": b_msgs,
                             "score": pa.array([1, 2, 3, 4], pa.int64()), "seed": [5, None, None, None],
                             "only_b": [{"k": i} for i in range(4)]}), d / "b.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                   d / "c-empty.parquet")
    pq.write_table(pa.table({"id": ["ok-d"], "prompt": pa.array(["def d():"], pa.large_string())}), d / "d.parquet")
    expected = {i: None for i in ("ok-a", "ok-b", "ok-d", "ctrl", *PATH_IDS)}
    expected.update({"null": "prompt and messages are both missing", "empty": "prompt is empty",
                     "blank": "whitespace-only", "utf8": "not valid UTF-8", "long": "context limit max_seq_len=64",
                     "temp": "column 'temperature' must be", "top_p": "column 'top_p' must be in (0, 1]",
                     "top_k": "column 'top_k' must be", "max0": "column 'max_new_tokens' must be",
                     "maxbig": "column 'max_new_tokens' must be",
                     "msg-json": "not valid JSON", "msg-empty": "non-empty list", "msg-surrogate": "not valid Unicode",
                     "oom-row": "OutOfMemoryError: simulated out of memory"})
    return expected


def test_bad_inputs_and_oom_end_to_end_rows_in_equal_rows_out(driver, tiny_orthrus_dir, tmp_path, monkeypatch):
    from pipeline.run.cluster import connect
    from pipeline.config_file import load_config
    from pipeline.run.job import preflight, run

    expected = _bad_input_shards(tmp_path / "in")
    monkeypatch.setenv("ORTHRUS_FAULT_INJECT", "oom_if_batch_gt:2,oom_on_id:oom-row")
    cfg = load_config(_job(tmp_path, tiny_orthrus_dir, sampling={"max_new_tokens": 4, "temperature": 0.5},
                           engine={"batch_size": 4, "max_batch_size": 4, "max_seq_len": 64}))
    before = {**tree_snapshot(tmp_path / "in"), **tree_snapshot(tiny_orthrus_dir)}
    summary = run(preflight(cfg), connect())
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(expected)  # rows in == rows out, each once
    for r in rows:
        want = expected[r["id"]]
        if want is None:
            assert r["error"] is None and r["finish_reason"] in ("stop", "length"), r
        else:
            assert r["finish_reason"] == "error" and want in r["error"], (r["id"], r["error"])
    by_id = {r["id"]: r for r in rows}
    assert by_id["ok-b"]["score"] == 1 and by_id["ok-a"]["score"] == 0      # int32 + int64 -> int64
    assert by_id["ok-b"]["only_b"] == {"k": 0} and by_id["ok-a"]["only_b"] is None
    assert summary["run"]["complete"] and summary["rows"]["total"] == len(expected)
    # Nothing written outside the output dir, and inside it only fixed names and run-id part names.
    assert {**tree_snapshot(tmp_path / "in"), **tree_snapshot(tiny_orthrus_dir)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "job.yaml", "out"]
    assert {p.name for p in (tmp_path / "out").iterdir()} == COMPLETE
    assert all(PART_NAME.fullmatch(p.name) for p in (tmp_path / "out" / "data").iterdir())
    assert not list((tmp_path / "out" / "_tmp").iterdir())


# ---------------------------------------------------------------- SIGKILL an actor, then the driver; re-submit

def test_actor_and_driver_sigkill_then_resubmit_exactly_once(head, tiny_orthrus_dir, tmp_path, monkeypatch):
    from ray.job_submission import JobStatus, JobSubmissionClient

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    everything = _shards(tmp_path / "in", 2, 20)
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"}, sampling={"max_new_tokens": 40},
               engine={"batch_size": 2, "max_batch_size": 2, "speculative": False})
    sid = f"faults-{os.getpid()}-{int(time.time())}"
    # each actor (the first, then Ray's restart) runs 4 batches, then holds the rest at a barrier never
    # released: both kills come mid-run, with 24 of 40 rows left at least, however fast or loaded the
    # machine (Ray Data may hold a finished block back from the driver, hence 4 for the 2 awaited)
    submitted = submit(head, job, wait=False, sid=sid,
                       env_vars={"ORTHRUS_FAULT_INJECT": f"hold_after:4:{tmp_path / 'never'}"})
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    client = JobSubmissionClient(head["dashboard"])
    job_id = wait_for(lambda: client.get_job_info(sid).job_id, "the driver to start")
    actor = wait_for(lambda: len(part_digests(out)) >= 1 and generation_actor(head, job_id), "a committed part")
    kill_pid(actor)                                                          # mid-run, mid-batch
    at_actor_kill = len(part_digests(out))
    wait_for(lambda: generation_actor(head, job_id) not in (0, actor), "Ray to restart the actor")
    wait_for(lambda: len(part_digests(out)) >= at_actor_kill + 2, "progress after the actor restart")
    kill_pid(int(client.get_job_info(sid).driver_info.pid))               # then the driver
    assert wait_for(lambda: client.get_job_status(sid) in (JobStatus.FAILED, JobStatus.STOPPED), "job end")
    before = part_digests(out)
    done = row_keys(out / "data" / name for name in before)
    print(f"parts: {at_actor_kill} at the actor kill, {len(before)} at the driver kill ({len(done)} rows)")
    assert len(done) == len(set(done)) and at_actor_kill < len(before) and 0 < len(done) < len(everything)

    resumed = submit(head, job, "--resume")                          # re-submit the same job
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    after = part_digests(out)
    assert all(after[name] == digest for name, digest in before.items())  # committed parts untouched
    new = row_keys(out / "data" / name for name in after if name not in before)
    assert not set(new) & set(done) and sorted(done + new) == everything  # nothing finished redone
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["complete"] and (run["rows_skipped_as_finished"], run["rows_generated"]) == \
        (len(done), len(everything) - len(done))


# ---------------------------------------------------------------- disk full mid-run

def test_disk_full_mid_run_clear_error_no_partial_files_then_resume(driver, tiny_orthrus_dir, tmp_path, capsys):
    import ray

    everything = _shards(tmp_path / "in", 1, 24)
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=40k", "tmpfs") as small:
        # a part per batch (output.part_bytes: 1), so the disk fills between commits
        job = _job(tmp_path, tiny_orthrus_dir, output={"path": str(small / "out"), "part_bytes": 1},
                   sampling={"max_new_tokens": 3},
                   # the default batches in flight: the commit loop waits for Ray Data's threads, so a
                   # later ray.shutdown() in this process (pytest itself) cannot kill it
                   engine={"batch_size": 2, "max_batch_size": 2})
        assert main_cli(["--config", str(job)]) == 3                 # exit 3: output write failed mid-run
        err = capsys.readouterr().err
        print(err[-1000:])
        assert "No space left on device" in err and "rerun with --resume" in err, err[-2000:]
        out = small / "out"
        assert {p.name for p in out.iterdir()} <= LAYOUT and not list((out / "_tmp").iterdir())
        before = part_digests(out)
        done = row_keys(out / "data" / name for name in before)       # every committed part reads back whole
        assert 0 < len(done) < len(everything) and len(done) == len(set(done))
        ray.shutdown()
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)  # space freed
        assert main_cli(["--config", str(job), "--resume"]) == 0
        after = part_digests(out)
        assert all(after[name] == digest for name, digest in before.items())
        assert sorted(row_keys(out / "data" / name for name in after)) == everything


def main_cli(argv: list[str]) -> int:
    """``python -m jobs.generate`` in this process (the driver fixture points it at the head)."""
    from jobs.generate import main

    return main(argv)


# ---------------------------------------------------------------- a corrupt page found mid-run

def test_a_corrupt_page_found_mid_run_exits_2_with_complete_parts_then_resume_after_repair(
        driver, tiny_orthrus_dir, tmp_path, capsys):
    """Preflight reads footers only, so a corrupt data page is found by its read task: exit 2 naming
    the file and row group, the parts committed so far complete; once the file is repaired,
    ``--resume`` generates exactly the rest."""
    import ray

    d = tmp_path / "in"
    d.mkdir()
    everything = []
    for s in range(2):     # four row groups each; the second file's third one gets corrupted
        ids = [f"c{s}-{i}" for i in range(16)]
        table = pa.table({"id": ids, "prompt": [f"def c{s}_{i}(a):  # " + "pad " * 200 for i in range(16)]})
        pq.write_table(table, d / f"c{s}.parquet", row_group_size=4)
        everything += [(i, 0) for i in ids]
    bad = d / "c1.parquet"
    good_bytes = bad.read_bytes()
    meta = pq.read_metadata(bad)
    column = meta.row_group(2).column(1)          # the prompt column's pages in row group 2
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    corrupt = bytearray(good_bytes)
    for i in range(start + 40, start + column.total_compressed_size - 8):
        corrupt[i] ^= 0x5A
    bad.write_bytes(bytes(corrupt))
    job = _job(tmp_path, tiny_orthrus_dir, output={"path": str(tmp_path / "out"), "part_bytes": 1},
               prompt={"chat_template": "off"}, sampling={"max_new_tokens": 2},
               engine={"batch_size": 4, "max_batch_size": 4})
    assert main_cli(["--config", str(job)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"input file .*c1.parquet is corrupt \(row group 2 of 4\)", err), err[-2000:]
    final = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(final) == 1 and "rerun with --resume" in final[0] and "orthrus input error" not in final[0], err[-3000:]
    assert "Corrupt snappy compressed data" in final[0]
    out = tmp_path / "out"
    assert not list((out / "_tmp").iterdir())
    before = part_digests(out)
    done = row_keys(out / "data" / name for name in before)            # every committed part reads back whole
    assert len(done) == len(set(done)) < len(everything)
    ray.shutdown()
    bad.write_bytes(good_bytes)                                      # the file is repaired
    assert main_cli(["--config", str(job), "--resume"]) == 0
    after = part_digests(out)
    assert all(after[name] == digest for name, digest in before.items())
    assert sorted(row_keys(out / "data" / name for name in after)) == sorted(everything)
