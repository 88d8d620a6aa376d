"""The job around the engine at scale: driver start-up, driver memory, resume and the commit path
(a section of the speed workload's job part; alone: ``python -m jobs.bench scale``).

Generation is near-free: :class:`NullStage` stands in for the generation actor and returns every
batch as finished rows (``finish_reason`` "length", an empty completion, no model), so what is
measured is everything else: preflight, Ray Data's read/preprocess graph, the driver's commit
loop, resume and the summary. Inputs are short one-line prompts in the same number of files
(``FILES``) at every size; they and the committed outputs are generated once into ``--cache``.

1. ``fresh``: one driver process per size (``python -m jobs.bench.scale --driver``: preflight, the
   lease and ``run`` with the null stage on an embedded local Ray), stopped by
   ``behaviour.max_wall_seconds`` shortly after the first batch (exit status 1 then). Start-up is
   from the process's spawn to the first batch reaching an actor; RSS is the driver's ``ru_maxrss``.
2. ``resume``: the same into an output holding every row but the last 1,000 (``scale_data.py``),
   with ``behaviour.resume`` to completion; start-up and RSS against the fresh run of that size,
   and the time the end-of-run summary took.
3. ``commit_path``: pre-built stage output blocks (64 rows) through ``CommitLoop`` + ``PartWriter``
   into a local directory and into moto's S3 server on loopback: rows/s and parts written.

Ratios are against the baseline measured in the same run; nothing asserts speed (shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.bench import common
from jobs.bench.scale_data import (BLOCK, FILES, REPO, copy_output, ids_of, job_config, swapped_blocks,
                                   write_committed, write_inputs)
from pipeline import schema as S
from pipeline.actor.records import BATCH_RECORD
from pipeline.requests.request import REQUEST

RESULT = "BENCH_SCALE_RESULT "
TARGETS = {"fresh_startup_ratio": 1.3, "fresh_rss_delta_mb": 100, "resume_startup_ratio": 1.5,
           "resume_rss_delta_mb": 100, "resume_summary_s": 2.0, "commit_local_rows_per_s": 20_000,
           "commit_s3_rows_per_s": 5_000, "commit_parts_per_1m_rows": 20}


class NullStage:
    """Stand-in for ``GenerationStage`` (same constructor): each row finishes at once, no model."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.actor = f"{os.getpid()}@null"

    def finish(self, batch: pa.Table, started: float) -> pa.Table:
        """The batch as finished output rows: request columns dropped, output columns and the
        batch record added; ids, coordinates and pass-through columns kept."""
        n = batch.num_rows
        failed = pc.is_valid(batch["error"])
        table = batch.drop_columns([c for c in (REQUEST, "error") if c in batch.column_names])
        cols = {"generated_text": pc.if_else(failed, pa.scalar(None, pa.string()), ""),
                "finish_reason": pc.if_else(failed, "error", "length"),
                "error": batch["error"],
                "num_generated_tokens": pc.if_else(failed, pa.scalar(None, pa.int64()), 0),
                "model": pa.repeat(pa.scalar(self.plan.model.path), n)}
        for name, values in cols.items():
            table = table.append_column(name, values)
        record = {"actor": self.actor, "gpu_ids": "", "call_id": uuid.uuid4().hex, "rows": n, "tokens": 0,
                  "seconds": time.time() - started, "started": started, "occupancy": None}
        return table.append_column(pa.field(S.BATCH, BATCH_RECORD),
                                   pa.array(([record] + [None] * (n - 1)) if n else [], BATCH_RECORD))

    async def __call__(self, batch: pa.Table) -> pa.Table:
        return self.finish(batch, time.time())


# ---------------------------------------------------------------- the driver process

def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn, seen: dict, key: str):
    """``fn`` that adds its duration to ``seen[key]``."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seen[key] = seen.get(key, 0.0) + time.perf_counter() - t
    return wrapper


def _instrument(job, seen: dict) -> None:
    """Record the earliest batch start the tracker sees; time the end-of-run summary and its plot."""
    import pipeline.report.summary as summary

    class Tracker(job.ThroughputTracker):
        def add_records(self, records: list[dict]) -> None:
            starts = [r["started"] for r in records if r["started"] is not None]
            if starts:
                seen["first_batch"] = min(starts + [seen.get("first_batch", starts[0])])
            super().add_records(records)

    job.ThroughputTracker = Tracker
    job.summarize = _timed(job.summarize, seen, "summary_s")
    summary.plot_png = _timed(summary.plot_png, seen, "summary_plot_s")


def driver(spawned: float, config: dict) -> int:
    """Preflight, lease and run with :class:`NullStage`; print one JSON line → exit status."""
    import pipeline.run.job as job
    from pipeline.config_file import load_config
    from pipeline.run.cluster import connect

    seen: dict = {"imported": time.time() - spawned}     # the job's modules (torch, Ray) loaded
    _instrument(job, seen)
    prepared = job.preflight(load_config(None, data=config))
    seen.update(preflight_done=time.time() - spawned, rss_after_preflight_mb=_rss_mb())
    echo = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with job.take_lease(prepared.out) as lease:
        prepared.out.lease = lease
        mode = connect()
        seen.update(ray_up=time.time() - spawned, rss_after_connect_mb=_rss_mb())
        seen["load_at_run"] = os.getloadavg()[0]
        summary = job.run(prepared, mode, stage_cls=NullStage, echo=echo)
    run, first = summary["run"], seen.pop("first_batch", None)
    result = {"startup_s": None if first is None else first - spawned,
              "startup_after_ray_s": None if first is None else first - spawned - seen["ray_up"],
              "peak_rss_mb": _rss_mb(), "parts_committed": run["parts_committed"], "wall_s": time.time() - spawned,
              "rows_generated": run["rows_generated"], "rows_skipped": run["rows_skipped_as_finished"],
              "complete": run["complete"], "stopped_by": run["stopped_by"], **seen}
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(RESULT + json.dumps(result), flush=True)
    return 0 if run["complete"] else 1


def drive(config: dict, ray_tmp: Path, timeout: float) -> dict:
    """Run one driver process (its own embedded Ray under ``ray_tmp``) → its result line, or
    ``{"error": ...}`` if it failed or ran past ``timeout`` (then SIGTERM, which shuts its Ray down)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    spawned = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.bench.scale", "--driver", json.dumps([spawned, config])],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": stderr[-1500:]}
    lines = [x for x in stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode not in (0, 1) or not lines:
        return {"error": f"exit status {proc.returncode}", "stderr_tail": stderr[-1500:]}
    return {**json.loads(lines[-1][len(RESULT):]), "exit_status": proc.returncode}


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM the driver (Ray's handler shuts its cluster down), then SIGKILL its process group."""
    proc.terminate()
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


# ---------------------------------------------------------------- the commit path alone

def stage_blocks(rows: int, files: int = FILES, model: str = "bench-model") -> list[pa.Table]:
    """What the null stage would return for ``rows`` rows over ``files`` files, in 64-row blocks
    (neighbouring blocks swapped, as actors return them out of order)."""
    from pipeline.actor.stage import StagePlan
    from pipeline.config import EngineConfig, ModelConfig

    stage = NullStage(StagePlan(ModelConfig(path=model), EngineConfig(), False))
    per = rows // files
    blocks = []
    for f in range(files):
        r = np.arange(per)
        n = per
        requests = pa.table({
            "id": ids_of(f, r), "sample_index": pa.array(np.zeros(n, np.int64)),
            "seed": pa.array(r * 7919, pa.int64()), "num_input_tokens": pa.array(np.full(n, 8, np.int64)),
            "error": pa.nulls(n, pa.string()),
            S.FILE: pa.array(np.full(n, f, np.int32)), S.ROW: pa.array(r),
            "shard": pa.array(np.full(n, f, np.int32))})
        order = swapped_blocks(-(-n // BLOCK), 1)
        blocks += [stage.finish(requests.slice(b * BLOCK, BLOCK), time.time()) for b in order]
    return blocks


def commit_path(out, blocks: list[pa.Table], files: int = FILES) -> dict:
    """Stream ``blocks`` through the driver's commit loop into ``out`` → rows/s and parts."""
    from pipeline.config import BehaviourConfig, OutputConfig
    from pipeline.output.parts import PartWriter
    from pipeline.report.progress import Progress
    from pipeline.report.throughput import ThroughputTracker
    from pipeline.run.commit import CommitLoop, run_loop

    out.prepare(BehaviourConfig(), {"bench": "commit_path"})
    schema = S.output_schema([pa.field("shard", pa.int32())])
    rows = sum(b.num_rows for b in blocks)
    defaults = OutputConfig(path="unused")
    writer = PartWriter(out, schema, tuple(f"/in/shard-{f:03d}.parquet" for f in range(files)), 1,
                        defaults.part_bytes, defaults.part_seconds)
    loop = CommitLoop(writer, schema, ThroughputTracker(), Progress(rows, 0, lambda _: None, bar=False))
    t = time.perf_counter()
    run_loop(iter(blocks), loop, None)
    seconds = time.perf_counter() - t
    return {"rows": rows, "blocks": len(blocks), "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds), "parts": out.committed}


def commit_paths(rows: int, tmp: Path, s3: bool = True) -> dict:
    """The commit path into a local directory and (``s3``) into moto's server on loopback."""
    from pipeline.config import StorageConfig
    from pipeline.output.directory import OutputDir

    blocks = stage_blocks(rows)
    report = {"local": commit_path(OutputDir(str(tmp / "commit-local")), blocks)}
    shutil.rmtree(tmp / "commit-local", ignore_errors=True)
    if s3:
        from jobs.local_s3 import CLIENT_ENV, moto_server, s3fs

        saved = {k: os.environ.get(k) for k in CLIENT_ENV}
        os.environ.update(CLIENT_ENV)
        try:
            with moto_server() as endpoint:
                s3fs(endpoint).create_dir("bench")
                out = OutputDir("s3://bench/commit", StorageConfig(endpoint=endpoint))
                report["s3"] = commit_path(out, blocks)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return report


# ---------------------------------------------------------------- the benchmark

def parse_size(text: str) -> int:
    """'0.2M' → 200000, '20k' → 20000, '500' → 500."""
    text = text.strip()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1].lower(), 1)
    return int(round(float(text[:-1] if scale > 1 else text) * scale))


def resume_sizes_for(sizes: list[str]) -> list[str]:
    """The sizes resumed by default: those of 2M rows and more, else the largest."""
    return [x for x in sizes if parse_size(x) >= 2_000_000] or sorted(sizes, key=parse_size)[-1:]


def _fresh_and_resume(sizes: list[str], resume_sizes: list[str], cache: Path, tmp: Path, max_wall: float) -> dict:
    fresh, resumed = {}, {}
    for label in sizes:
        inputs = write_inputs(cache / f"in-{parse_size(label)}-{FILES}", parse_size(label))
        print(f"[scale] fresh run, {label} rows in {FILES} files ...", flush=True)
        fresh[label] = drive(job_config(inputs, tmp / f"fresh-{label}", max_wall=max_wall), tmp, max_wall + 300)
        shutil.rmtree(tmp / f"fresh-{label}", ignore_errors=True)
        print(f"[scale] fresh {label}: {fresh[label]}", flush=True)
    for label in resume_sizes:
        inputs = write_inputs(cache / f"in-{parse_size(label)}-{FILES}", parse_size(label))
        print(f"[scale] resume run, {label} rows with 1,000 left ...", flush=True)
        t = time.perf_counter()
        built = write_committed(inputs, cache / f"out-{parse_size(label)}-{FILES}")
        build_s = time.perf_counter() - t
        out = copy_output(built, tmp / f"resume-{label}")
        resumed[label] = drive(job_config(inputs, out, resume=True), tmp, 900)
        resumed[label]["output_build_s"] = round(build_s, 1)
        shutil.rmtree(out, ignore_errors=True)
        print(f"[scale] resume {label}: {resumed[label]}", flush=True)
    return {"fresh": fresh, "resume": resumed}


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    x, y = (a or {}).get(key), (b or {}).get(key)
    return round(x / y, 3) if x is not None and y else None


def _delta(a: dict | None, b: dict | None, key: str) -> float | None:
    x, y = (a or {}).get(key), (b or {}).get(key)
    return round(x - y, 1) if x is not None and y is not None else None


def compare(report: dict) -> dict:
    """Ratios against the baseline of the same run, and each target met or missed."""
    fresh, resumed, commit = report["fresh"], report["resume"], report.get("commit_path", {})
    base_label = min(fresh, key=parse_size) if fresh else None
    base = fresh[base_label] if fresh else None
    checks: dict[str, dict] = {}

    def check(name: str, value, target: float, at_most: bool = True, run: dict | None = None) -> None:
        met = None if value is None else (value <= target if at_most else value >= target)
        checks[name] = {"value": value, "target": f"{'<=' if at_most else '>='} {target:g}", "met": met}
        if value is None and run is not None:     # the run itself says why there is no value
            checks[name].update(met=False, why=run.get("error") or "no batch reached an actor within the run")

    for label, r in fresh.items():
        if base is not None and r is not base:
            check(f"fresh_startup_ratio@{label}", _ratio(r, base, "startup_s"), TARGETS["fresh_startup_ratio"],
                  run=r if base.get("startup_s") else None)
            check(f"fresh_rss_delta_mb@{label}", _delta(r, base, "peak_rss_mb"), TARGETS["fresh_rss_delta_mb"])
    for label, r in resumed.items():
        against = label if (fresh.get(label) or {}).get("startup_s") else base_label   # a fresh run with a start-up
        if against is not None:
            check(f"resume_startup_ratio@{label}", _ratio(r, fresh[against], "startup_s"),
                  TARGETS["resume_startup_ratio"], run=r if fresh[against].get("startup_s") else None)
            checks[f"resume_startup_ratio@{label}"]["against"] = f"fresh {against}"
        if label in fresh:
            check(f"resume_rss_delta_mb@{label}", _delta(r, fresh[label], "peak_rss_mb"),
                  TARGETS["resume_rss_delta_mb"])
        check(f"resume_summary_s@{label}", r.get("summary_s"), TARGETS["resume_summary_s"], run=r)
    if "local" in commit:
        local = commit["local"]
        check("commit_local_rows_per_s", local["rows_per_s"], TARGETS["commit_local_rows_per_s"], False)
        if local["rows"] >= 1_000_000:      # parts come by size and age: a shorter run says nothing
            check("commit_parts_per_1m_rows", round(local["parts"] * 1_000_000 / local["rows"], 1),
                  TARGETS["commit_parts_per_1m_rows"])
    if "s3" in commit:
        check("commit_s3_rows_per_s", commit["s3"]["rows_per_s"], TARGETS["commit_s3_rows_per_s"], False)
    return checks


def scale_report(sizes: list[str] = ("0.2M", "2M", "20M"), resume_sizes: list[str] = ("2M", "20M"),
                 cache: str = "/tmp/orthrus-bench-scale", max_wall: float = 60.0, commit_rows: int = 1_000_000,
                 s3: bool = True) -> dict:
    """Every measurement of this module, with the targets (see the module docstring)."""
    cache_dir = Path(cache)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="obs-", dir="/tmp"))    # short: Ray's socket paths live under it
    try:
        report = {"files": FILES, "block_rows": BLOCK, "max_wall_seconds": max_wall,
                  **_fresh_and_resume(list(sizes), list(resume_sizes), cache_dir, tmp, max_wall)}
        if commit_rows:
            print(f"[scale] commit path, {commit_rows} rows in {BLOCK}-row blocks ...", flush=True)
            report["commit_path"] = commit_paths(commit_rows, tmp, s3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["targets"] = compare(report)
    return report


def add_args(ap) -> None:
    """The scale workload's own arguments."""
    ap.add_argument("--sizes", "--scale-sizes", dest="sizes", default="0.2M,2M,20M",
                    help="input rows of the fresh runs (the first is the baseline)")
    ap.add_argument("--resume-sizes", default=None,
                    help="sizes of the resume runs (default: those of 2M and more, else the largest; '' for none)")
    ap.add_argument("--cache", default="/tmp/orthrus-bench-scale", help="where inputs and outputs are generated once")
    ap.add_argument("--max-wall", type=float, default=60.0, help="behaviour.max_wall_seconds of the fresh runs")
    ap.add_argument("--commit-rows", type=int, default=1_000_000, help="rows through the commit path (0: skip)")
    ap.add_argument("--no-s3", dest="s3", action="store_false", help="skip the S3 commit path")


def main(args: argparse.Namespace) -> None:
    """Every measurement → ``bench-results/scale.json`` (and the targets, printed)."""
    split = lambda s: [x for x in s.split(",") if x.strip()]  # noqa: E731
    resume = resume_sizes_for(split(args.sizes)) if args.resume_sizes is None else split(args.resume_sizes)
    report = scale_report(split(args.sizes), resume, args.cache, args.max_wall, args.commit_rows, args.s3)
    print(json.dumps(report, indent=2))
    print(render_targets(report["targets"]))
    common.write_report(args, report)


def render_targets(checks: dict) -> str:
    """One line per target: value, target, met or missed."""
    mark = {True: "met", False: "MISSED", None: "n/a"}
    return "\n".join(f"  {name:<34} {str(c['value']):>10}  (target {c['target']}): {mark[c['met']]}"
                     + (f" vs {c['against']}" if "against" in c else "")
                     + (f" -- {c['why']}" if "why" in c else "") for name, c in checks.items())


if __name__ == "__main__":      # python -m jobs.bench.scale --driver JSON: one driver process of ``drive``
    sys.exit(driver(*json.loads(sys.argv[2])))
