"""The Ray Data job against the bare engine, on the same rows (part of ``jobs/bench.py``, CPU only).

``skewed_job``: a length-skewed workload (per-row ``max_new_tokens`` spread 8 … 256, stop strings
that end rows at varied points) run three ways in one go: the bare engine with every row in one
streaming ``generate``; the Ray Data job with several batches in flight per actor (the streaming
design); and the same job with one batch at a time (``engine.max_concurrent_batches=1``: the engine
drains at every batch boundary, the design before the streaming engine). Ratios of steady
tokens/s (from the first committed block on, so Ray's and the model's start-up are left out) and
the job's mean slot occupancy are what to read.
"""
from __future__ import annotations

import json
import os
import random
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


def _run_job(config: str, sets: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "jobs.generate", "--config", config]
    for kv in sets + [f"output.path={out}", "behaviour.overwrite=true"]:
        cmd += ["--set", kv]
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    return json.loads((out / "summary.json").read_text())


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
        summary = _run_job(config, sets + extra, tmp / name)
        run = summary["run"]
        report[name] = {"steady_tokens_per_s": run["steady_tokens_per_second"], "wall_s": run["wall_seconds"],
                        "slot_occupancy": run["slot_occupancy"], "slot_occupancy_whole_run": run["slot_occupancy_whole_run"],
                        "tokens": run["completion_tokens"], "decoded_after_stop": summary["tokens"]["decoded_after_stop"],
                        "finish_reason": summary["rows"]["finish_reason"]}
        slots = int(summary["config"]["engine"]["max_batch_size"])
    # The baseline gets the actor's thread budget: the actor has 1 CPU, and Ray sets OMP_NUM_THREADS=1
    # for it, which also caps the BLAS/OpenMP pools that torch.set_num_threads(1) alone leaves at
    # the core count (measured here: ~10-20% faster than the actor's budget on this 2-core VM).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "jobs.bench_job", str(tmp / "in" / "rows.parquet"), model_path, str(slots),
           json.dumps(STOPS)]
    bare_run = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                                         timeout=3600).stdout.splitlines()[-1])
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
    summary = _run_job(config, ["prompt.chat_template=off", "sampling.stop=[]",
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
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from pipeline import schema as S
    from pipeline.config import load_config
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
        if c.text is None:              # not ended by a stop string
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


if __name__ == "__main__":   # python -m jobs.bench_job ROWS.parquet MODEL SLOTS STOPS_JSON (skewed_job's baseline)
    print(json.dumps(bare_engine(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))))
