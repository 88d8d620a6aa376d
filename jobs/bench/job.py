"""The job around the engine: the speed workload's job sections (CPU, with ``--job``; ``job_sections``).

``job_vs_engine``: the Ray Data job against the bare engine, on the same rows.

``skewed_job``: a length-skewed workload (per-row ``max_new_tokens`` spread 8 … 256, stop strings
that end rows at varied points) run three ways in one go: the bare engine with every row in one
streaming ``generate``; the Ray Data job with several batches in flight per actor (the streaming
design); and the same job with one batch at a time (``engine.max_concurrent_batches=1``: the engine
drains at every batch boundary, the design before the streaming engine). Ratios of steady
tokens/s (from the first committed block on, so Ray's and the model's start-up are left out) and
the job's mean slot occupancy are what to read.

``audit_overhead``: what the lossless audit costs. The generation actor's stage runs in this
process (no Ray) over one batch of held-out prompts, greedy, with ``audit.fraction`` 0, 0.05 and 1;
the three are interleaved ``reps`` times and the median batch time of each is compared with
fraction 0 measured in the same run. Reported: the audited rows and the slowdown. The audited rows
also must all match (float32).

Also: ``shared_prefill`` (n samples per prompt prefill once), ``stop_string_waste`` (tokens decoded
after a stop string, before and now), and the storage (``storage.py``) and scale (``scale.py``)
sections.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams

STOPS = ["\ndef ", "\n\n", "return "]


def run_job(config: str, sets: list[str], out: Path) -> dict:
    """The job (``python -m jobs.generate``) with ``--set`` overrides into ``out`` → its ``summary.json``."""
    cmd = [sys.executable, "-m", "jobs.generate", "--config", config]
    for kv in sets + [f"output.path={out}", "behaviour.overwrite=true"]:
        cmd += ["--set", kv]
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    return json.loads((out / "summary.json").read_text())


def actor_budget_run(module: str, *argv: str) -> dict:
    """``python -m module *argv`` in its own process with a generation actor's thread budget → the
    JSON of its last output line. The actor has 1 CPU, and Ray sets OMP_NUM_THREADS=1 for it, which
    also caps the BLAS/OpenMP pools that torch.set_num_threads(1) alone leaves at the core count
    (measured here: ~10-20% faster than the actor's budget on a 2-core VM)."""
    out = subprocess.run([sys.executable, "-m", module, *argv], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         check=True, capture_output=True, text=True, timeout=3600).stdout
    return json.loads(out.splitlines()[-1])


def skewed_rows(prompts_dir: str, rows: int, seed: int = 0) -> pa.Table:
    """``rows`` held-out prompts (cycled) with per-row ``max_new_tokens`` drawn log-uniformly in 8 … 256."""
    texts = pads.dataset(prompts_dir, format="parquet").to_table(columns=["prompt"]).column("prompt").to_pylist()
    rnd = random.Random(seed)
    lengths = [int(round(8 * 32 ** rnd.random())) for _ in range(rows)]
    return pa.table({"id": [f"s{i}" for i in range(rows)], "prompt": [texts[i % len(texts)] for i in range(rows)],
                     "max_new_tokens": pa.array(lengths, pa.int64())})


def skewed_job(model_path: str, prompts_dir: str, config: str, rows: int = 256) -> dict:
    """Bare engine vs the streaming job vs the batch-at-a-time job on a length-skewed workload."""
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-skewed-"))
    table = skewed_rows(prompts_dir, rows)
    (tmp / "in").mkdir()
    pq.write_table(table, tmp / "in" / "rows.parquet")
    stops = "[" + ", ".join(json.dumps(s) for s in STOPS) + "]"
    sets = ["prompt.chat_template=off", f"sampling.stop={stops}", "engine.speculative=true",
            f"input.paths=[{tmp / 'in'}]", f"model.path={model_path}"]
    report: dict = {"rows": rows, "stops": STOPS, "max_new_tokens": "8..256 log-uniform"}
    for name, extra in (("streaming", []), ("batch_at_a_time", ["engine.max_concurrent_batches=1"])):
        summary = run_job(config, sets + extra, tmp / name)
        run = summary["run"]
        report[name] = {"steady_tokens_per_s": run["steady_tokens_per_second"], "wall_s": run["wall_seconds"],
                        "slot_occupancy": run["slot_occupancy"], "slot_occupancy_whole_run": run["slot_occupancy_whole_run"],
                        "tokens": run["completion_tokens"], "decoded_after_stop": summary["tokens"]["decoded_after_stop"],
                        "finish_reason": summary["rows"]["finish_reason"]}
        slots = int(summary["config"]["engine"]["max_batch_size"])
    bare_run = actor_budget_run("jobs.bench.job", str(tmp / "in" / "rows.parquet"), model_path, str(slots),
                                json.dumps(STOPS))
    bare = max(bare_run["tokens_per_s"])
    report["bare_engine_tokens_per_s"] = bare
    report["bare_engine_runs_tokens_per_s"] = bare_run["tokens_per_s"]
    report["bare_engine_slot_occupancy"] = bare_run["slot_occupancy"]
    for name in ("streaming", "batch_at_a_time"):
        steady = report[name]["steady_tokens_per_s"]
        report[name]["steady_over_bare_engine"] = steady / bare if steady else None
    return report


def job_vs_engine(model: OrthrusForCausalLM, model_path: str, prompts: list[list[int]], config: str,
                  max_new_tokens: int) -> dict:
    """The Ray Data job (embedded Ray, demo config, raw prompts, no stop strings) vs the bare engine
    on the same token ids, slots and sampling: the pipeline's overhead as a throughput ratio."""
    out = Path(tempfile.mkdtemp(prefix="orthrus-bench-job-")) / "out"
    summary = run_job(config, ["prompt.chat_template=off", "sampling.stop=[]",
                                f"sampling.max_new_tokens={max_new_tokens}", "engine.speculative=true",
                                f"model.path={model_path}"], out)
    run = summary["run"]
    engine = OrthrusEngine(model, max_batch_size=int(summary["config"]["engine"]["max_batch_size"]))
    t = time.perf_counter()
    res = engine.generate(prompts, [SamplingParams(max_new_tokens=max_new_tokens, seed=i)
                                    for i in range(len(prompts))])
    bare = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)
    steady = run["steady_tokens_per_second"]
    return {"job_tokens_per_s": run["tokens_per_second"], "job_wall_s": run["wall_seconds"],
            "job_startup_s": run["startup_seconds"], "job_steady_tokens_per_s": steady,
            "engine_tokens_per_s": bare, "job_over_engine": run["tokens_per_second"] / bare,
            "steady_job_over_engine": steady / bare if steady else None, "rows": len(prompts),
            "slot_occupancy": run["slot_occupancy"]}


def stop_string_waste(config_path: str) -> dict:
    """The demo job's rows (the pipeline's own preprocessing, no Ray) decoded by the bare engine with
    stop strings applied after decoding (the design before the streaming engine: a row decodes to
    EOS or ``max_new_tokens``) and inside the engine (now): tokens decoded after the token that
    completed a stop string, summed. Greedy, so both runs decode the same sequence up to the stop."""
    from transformers import AutoTokenizer

    from pipeline.config_file import load_config
    from pipeline.run.job import preflight
    from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
    from pipeline.inputs.source import read_file

    cfg = load_config(config_path, [])
    inputs = preflight(cfg).inputs
    plan = PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling)
    rows = pa.concat_tables([preprocess_batch(read_file(inputs, i, cfg.sampling.n), plan)
                           for i in range(len(inputs.files))]).to_pylist()
    rows = [r for r in rows if r["error"] is None]
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(cfg.model.path), max_batch_size=cfg.engine.max_batch_size,
                           tokenizer=tok)
    ids, stops = [r["__request"]["prompt_token_ids"] for r in rows], tuple(cfg.sampling.stop)
    plain = engine.generate(ids, [SamplingParams(max_new_tokens=r["__request"]["max_tokens"]) for r in rows])
    cut = engine.generate(ids, [SamplingParams(max_new_tokens=r["__request"]["max_tokens"], stop=stops) for r in rows])
    before = after = stopped = 0
    for p, c in zip(plain, cut):
        if not isinstance(c.stop_reason, str):    # not ended by a stop string
            continue
        assert p.token_ids[: len(c.token_ids)] == c.token_ids
        end = next(n for n in range(1, len(p.token_ids) + 1)
                   if c.stop_reason in tok.decode(p.token_ids[:n], skip_special_tokens=True))
        stopped += 1
        before += len(p.token_ids) - end
        after += c.stats.num_tokens_after_stop
    return {"rows": len(rows), "rows_ended_by_stop_string": stopped, "decoded_after_stop_before": before,
            "decoded_after_stop_now": after, "block_size": engine.block_size}


def shared_prefill(model: OrthrusForCausalLM, prompts: list[list[int]], slots: int = 8, n: int = 4,
                   max_new_tokens: int = 64) -> dict:
    """n sampled completions per prompt through ``slots`` slots, samples submitted together (as the
    pipeline does): prompt tokens computed by prefills, against the prompts' lengths."""
    engine = OrthrusEngine(model, max_batch_size=slots)
    rows = [p for p in prompts for _ in range(n)]
    params = [SamplingParams(temperature=0.7, max_new_tokens=max_new_tokens, seed=i) for i in range(len(rows))]
    engine.generate(rows, params)
    once = sum(len(p) for p in prompts)
    return {"prompts": len(prompts), "n": n, "slots": slots, "prefill_tokens": engine.stats.prefill_tokens,
            "prompt_tokens_once": once, "prefill_tokens_per_prompt_token": engine.stats.prefill_tokens / once}


def bare_engine(rows_path: str, model_path: str, slots: int, stops: list[str], runs: int = 2) -> dict:
    """The rows of ``rows_path`` in one ``generate`` on the bare engine, ``runs`` times (the better run
    counts: a shared machine drifts)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    table = pq.read_table(rows_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(model_path), max_batch_size=slots, tokenizer=tok)
    ids = tok(table["prompt"].to_pylist(), add_special_tokens=False)["input_ids"]
    params = [SamplingParams(max_new_tokens=n, stop=tuple(stops)) for n in table["max_new_tokens"].to_pylist()]
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        res = engine.generate(ids, params)
        rates.append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t))
    return {"tokens_per_s": rates, "slot_occupancy": engine.stats.busy_slot_iterations / (engine.stats.iterations * slots)}


def audit_overhead(model_dir: str, prompts_dir: str, rows: int = 64, max_new_tokens: int = 64, reps: int = 3,
                   fractions: tuple[float, ...] = (0.0, 0.05, 1.0), slots: int = 8) -> dict:
    """Median batch seconds per audit fraction, and each one's ratio to no audit."""
    from pipeline.actor.stage import GenerationStage, StagePlan
    from pipeline.config import AuditConfig
    from pipeline.config_file import load_config
    from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
    from pipeline.inputs.source import read_file
    from pipeline.run.job import preflight

    texts = pads.dataset(prompts_dir, format="parquet").to_table(columns=["prompt"]).column("prompt").to_pylist()
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-audit-"))
    (tmp / "in").mkdir()
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(rows)], "prompt": [texts[i % len(texts)] for i in range(rows)]}),
                   tmp / "in" / "rows.parquet")
    cfg = load_config(None, data={"input": {"paths": [str(tmp / "in")]}, "output": {"path": str(tmp / "out")},
                                  "model": {"path": model_dir}, "prompt": {"chat_template": "off"},
                                  "sampling": {"max_new_tokens": max_new_tokens},
                                  "engine": {"max_batch_size": slots, "dtype": "float32"}})
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    stages = {f: GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False,
                                           audit=AuditConfig(fraction=f, max_batch_size=max(1, slots // 2))))
              for f in fractions}
    seconds: dict[float, list[float]] = {f: [] for f in fractions}
    audited: dict[float, tuple[int, int]] = {}
    for _ in range(reps):
        for f, stage in stages.items():
            start = time.perf_counter()
            out = asyncio.run(stage(batch)).to_pylist()
            seconds[f].append(time.perf_counter() - start)
            flags = [r["audit_match"] for r in out if r["audit_match"] is not None]
            audited[f] = (len(flags), sum(flags))
    base = statistics.median(seconds[fractions[0]])
    return {"rows": rows, "max_new_tokens": max_new_tokens, "slots": slots, "reps": reps,
            "by_fraction": {str(f): {"median_batch_s": round(statistics.median(s), 3),
                                     "x_no_audit": round(statistics.median(s) / base, 3),
                                     "rows_audited": audited[f][0], "exact_matches": audited[f][1]}
                            for f, s in seconds.items()}}


def job_sections(report: dict, args, model: OrthrusForCausalLM, prompts) -> None:
    """The job around the engine (CPU): Ray Data job vs bare engine, audit, storage, scale."""
    from jobs.bench import scale, storage
    report["job_vs_engine"] = job_vs_engine(model, args.model, prompts, args.job_config, args.max_new_tokens)
    print(f"Ray Data job vs bare engine: {report['job_vs_engine']}", flush=True)
    report["skewed_job"] = skewed_job(args.model, args.prompts, args.job_config, args.skewed_rows)
    print(f"Length-skewed workload, job vs bare engine: {report['skewed_job']}", flush=True)
    report["shared_prefill"] = shared_prefill(model, prompts[:16])
    print(f"n = 4 samples per prompt, prefill: {report['shared_prefill']}", flush=True)
    report["stop_strings"] = stop_string_waste(args.job_config)
    print(f"Tokens decoded after stop strings (demo job rows): {report['stop_strings']}", flush=True)
    report["audit_overhead"] = audit_overhead(args.model, args.prompts)
    print(f"Lossless audit, batch time by audit.fraction: {report['audit_overhead']}", flush=True)
    report["storage"] = storage.storage_vs_local(args.model, args.prompts, args.job_config)
    print(f"Same job, local disk vs an S3 endpoint on loopback: {report['storage']}", flush=True)
    if args.scale_sizes:
        sizes = [x for x in args.scale_sizes.split(",") if x.strip()]
        report["scale"] = scale.scale_report(sizes, scale.resume_sizes_for(sizes))
        print("The job around the engine at scale (null stage):\n"
              + scale.render_targets(report["scale"]["targets"]), flush=True)


if __name__ == "__main__":   # python -m jobs.bench.job ROWS.parquet MODEL SLOTS STOPS_JSON (skewed_job's baseline)
    print(json.dumps(bare_engine(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))))
