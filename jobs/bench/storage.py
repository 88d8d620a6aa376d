"""Storage: the same greedy job with inputs, model and output on local disk and on an S3 endpoint
(a section of the speed workload's job part; alone: ``python -m jobs.bench storage``).

The S3 endpoint is moto's server on loopback (``jobs/local_s3.py``): it measures what the object
store path costs the job (listing, ranged reads of the inputs, one PUT per committed part, the
model download into the node cache), not a real network. Runs alternate local, S3, local, S3...
in one process tree; the ratio of medians of steady tokens/s (from the first committed part on, so
start-up is left out) is what to read, and the rows of both must be identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs.bench import common
from jobs.local_s3 import CLIENT_ENV, moto_server, s3fs, upload

_ROW_COLUMNS = ["id", "sample_index", "completion", "finish_reason"]


def _inputs(prompts_dir: str, rows: int, dest: Path) -> None:
    texts = pads.dataset(prompts_dir, format="parquet").to_table(columns=["prompt"]).column("prompt").to_pylist()
    dest.mkdir(parents=True)
    per = (rows + 3) // 4
    for s in range(4):
        ids = range(s * per, min(rows, (s + 1) * per))
        pq.write_table(pa.table({"id": [f"r{i}" for i in ids], "prompt": [texts[i % len(texts)] for i in ids]}),
                       dest / f"shard-{s}.parquet")


def _run(config: str, sets: list[str], env: dict) -> None:
    cmd = [sys.executable, "-m", "jobs.generate", "--config", config, "--overwrite"]
    for kv in sets:
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **env})
    if proc.returncode:
        raise RuntimeError(f"job failed ({proc.returncode}): {proc.stderr[-2000:]}")


def storage_vs_local(model_path: str, prompts_dir: str, config: str, rows: int = 256, reps: int = 2) -> dict:
    """Steady tokens/s of the job on local disk and on S3 (alternating ``reps`` times each)."""
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-storage-"))
    _inputs(prompts_dir, rows, tmp / "in")
    common = ["prompt.chat_template=off", "sampling.stop=[]", "sampling.max_new_tokens=64", "audit.fraction=0"]
    steady: dict[str, list[float]] = {"local": [], "s3": []}
    with moto_server() as endpoint:
        fs = s3fs(endpoint)
        fs.create_dir("bench")
        upload(fs, tmp / "in", "bench/in")
        upload(fs, Path(model_path), "bench/model")
        where = {"local": [f"input.paths=[{tmp / 'in'}]", f"output.path={tmp / 'out'}", f"model.path={model_path}"],
                 "s3": ["input.paths=[s3://bench/in]", "output.path=s3://bench/out", "model.path=s3://bench/model",
                        f"storage.endpoint={endpoint}", f"storage.model_cache_dir={tmp / 'cache'}"]}
        for _ in range(reps):
            for name in ("local", "s3"):
                _run(config, common + where[name], CLIENT_ENV)
                if name == "local":
                    summary = json.loads((tmp / "out" / "summary.json").read_text())
                    local_rows = pq.read_table(tmp / "out" / "data", columns=_ROW_COLUMNS).sort_by("id")
                else:
                    with fs.open_input_stream("bench/out/summary.json") as f:
                        summary = json.loads(f.read())
                    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector("bench/out/data")))
                    s3_rows = pa.concat_tables([pq.read_table(f, filesystem=fs, columns=_ROW_COLUMNS)
                                                for f in files]).sort_by("id")
                steady[name].append(summary["run"]["steady_tokens_per_second"])
    local, remote = statistics.median(steady["local"]), statistics.median(steady["s3"])
    return {"rows": rows, "reps": reps, "steady_tokens_per_s": steady, "median_local": round(local, 1),
            "median_s3": round(remote, 1), "s3_over_local": round(remote / local, 3),
            "rows_identical": local_rows.equals(s3_rows)}


def add_args(ap) -> None:
    """``--rows`` of the job (2 reps each by default)."""
    ap.add_argument("--rows", type=int, default=256)
    ap.set_defaults(reps=2)


def main(args: argparse.Namespace) -> None:
    """Local vs S3 → ``bench-results/storage.json``."""
    report = storage_vs_local(args.model, args.prompts, args.job_config, args.rows, args.reps)
    print(json.dumps(report, indent=2))
    common.write_report(args, report)
