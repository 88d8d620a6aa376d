"""Short outputs through the job: what the frame around the engine costs when rows are 1 token long.

    python -m jobs.bench short                  # writes bench-results/short.json
    python -m jobs.bench short --rows 20000 --max-new-tokens 1

Labelling and scoring jobs ask for 1-4 tokens per row, so per-row work outside the engine (the
conversions from batch to requests and from results back to columns, the actor call, detokenize,
commit) weighs as much as decoding. One run, in this order: the bare engine on ``--rows`` distinct
short prompts (tokenized as the job does with ``prompt.chat_template: off``; ``--slots`` slots,
float32, greedy, in a process with the actor's thread budget: one thread; best of two), the Ray
Data job on the same rows (embedded local Ray, ``--config`` with the bench's overrides: raw
prompts, ``max_new_tokens``, the same slots, float32, no audit), the bare engine again. Reported:
the job's steady rows/s (``summary.json`` ``run.steady_rows_per_second``: from an actor's first
batch to the last block, start-up excluded) ÷ the mean of the two bare-engine rates (target
>= 0.8), and the actor's own rows per second of engine time (what separates it from the job's rate
is the frame around the engine; what separates it from the bare engine is the same engine running
beside the job's other processes on the same cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.bench import common
from jobs.bench.job import actor_budget_run, run_job


def short_rows(rows: int) -> pa.Table:
    """``rows`` distinct short prompts (a Python signature each: 5-8 tokens with the bundled tokenizer)."""
    return pa.table({"id": [f"q{i}" for i in range(rows)], "prompt": [f"def f{i}(x):" for i in range(rows)]})


def job(config: str, model: str, inputs: Path, out: Path, slots: int, max_new: int, batch_size: int | None) -> dict:
    """The job on ``inputs`` → its run figures (``summary.json["run"]`` and the row counts)."""
    sets = ["prompt.chat_template=off", "sampling.stop=[]", f"sampling.max_new_tokens={max_new}",
            f"engine.max_batch_size={slots}", "engine.speculative=true",
            "engine.dtype=float32", "audit.fraction=0", f"input.paths=[{inputs}]", f"model.path={model}"]
    # null: the job's default, rows per call sized by work (the demo config sets its own 32)
    sets.append(f"engine.batch_size={'null' if batch_size is None else batch_size}")
    summary = run_job(config, sets, out)
    run = summary["run"]
    busy = sum(a["busy_seconds"] for a in run["actors"])
    return {"rows": summary["rows"]["total"], "steady_rows_per_s": run["steady_rows_per_second"],
            "steady_tokens_per_s": run["steady_tokens_per_second"], "wall_s": run["wall_seconds"],
            "startup_s": run["startup_seconds"], "engine_busy_s": busy,
            "rows_per_engine_second": run["rows_generated"] / busy if busy else None,
            "rows_ended_at_prefill": summary["speculation"]["rows_ended_at_prefill"],
            "completion_tokens": summary["tokens"]["completion"]}


def bare_engine(rows_path: str, model_path: str, slots: int, max_new: int, runs: int = 2) -> dict:
    """The rows of ``rows_path`` in one ``generate`` on the bare engine, tokenized as the job does with
    ``prompt.chat_template: off``; ``runs`` times, each rate reported."""
    import torch
    from transformers import AutoTokenizer

    from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams

    torch.set_num_threads(1)
    texts = pq.read_table(rows_path)["prompt"].to_pylist()
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(model_path, dtype=torch.float32), max_batch_size=slots,
                           tokenizer=tok)
    ids = tok(texts, add_special_tokens=True)["input_ids"]
    params = [SamplingParams(max_new_tokens=max_new, seed=i) for i in range(len(ids))]
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        engine.generate(ids, params)
        rates.append(len(ids) / (time.perf_counter() - t))
    return {"rows_per_s": rates, "prompt_tokens": sum(map(len, ids))}


def run(args: argparse.Namespace) -> dict:
    """Bare engine, job, bare engine again → the report (printed as it goes)."""
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-short-"))
    (tmp / "in").mkdir()
    pq.write_table(short_rows(args.rows), tmp / "in" / "rows.parquet", row_group_size=args.row_group)
    report: dict = {"rows": args.rows, "max_new_tokens": args.max_new_tokens, "slots": args.slots,
                    "batch_size": args.batch_size, "config": args.job_config}
    # The baseline runs right before and right after the job and the job is compared with their
    # mean: on a shared machine the load drifts, and bracketing spreads the drift over both sides.
    before = _bare(tmp / "in" / "rows.parquet", args)
    report["job"] = job(args.job_config, args.model, tmp / "in", tmp / "out", args.slots, args.max_new_tokens,
                        args.batch_size)
    print(f"job: {report['job']}", flush=True)
    after = _bare(tmp / "in" / "rows.parquet", args)
    report["bare_engine"] = {"rows_per_s_before_job": before["rows_per_s"], "rows_per_s_after_job": after["rows_per_s"]}
    bare = (max(before["rows_per_s"]) + max(after["rows_per_s"])) / 2
    steady = report["job"]["steady_rows_per_s"]
    report["bare_engine_rows_per_s"] = bare
    report["job_over_bare_engine"] = steady / bare if steady else None
    report["target >= 0.8"] = bool(steady and steady / bare >= 0.8)
    print(f"short outputs ({args.rows} rows, {args.max_new_tokens} new token(s), {args.slots} slots): job steady "
          f"{steady:.0f} rows/s, bare engine {bare:.0f} rows/s (before the job {max(before['rows_per_s']):.0f}, "
          f"after {max(after['rows_per_s']):.0f}): x{report['job_over_bare_engine']:.2f} (target 0.8); the actor's "
          f"rows per second of engine time: {report['job']['rows_per_engine_second']:.0f}", flush=True)
    return report


def _bare(rows: Path, args: argparse.Namespace) -> dict:
    """The bare engine on ``rows`` in its own process, with the actor's thread budget."""
    return actor_budget_run("jobs.bench.short", str(rows), args.model, str(args.slots), str(args.max_new_tokens))


def add_args(ap) -> None:
    """The short workload's own arguments (1 new token by default)."""
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--slots", type=int, default=64, help="engine.max_batch_size, and the bare engine's slots")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="engine.batch_size (rows per actor call); default: the job's own (sized by work)")
    ap.add_argument("--row-group", type=int, default=2000, help="input row-group size (one read task each)")
    ap.set_defaults(max_new_tokens=1)


def main(args: argparse.Namespace) -> None:
    """The job vs the bare engine → ``bench-results/short.json``."""
    common.write_report(args, run(args))


if __name__ == "__main__":     # the baseline's own process: ROWS MODEL SLOTS MAX_NEW
    print(json.dumps(bare_engine(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
