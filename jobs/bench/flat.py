"""The flat step: token positions computed for prompts, and how long running rows wait behind them,
against the engine at a git ref (``--before``), in ONE process.

    python -m jobs.bench flat                       # --before f000003 (padded prefill); bench-results/flat.json

A seeded workload of ``--rows`` prompts whose lengths are log-uniform in ``--min-len``…``--max-len``
tokens (random ids), ``--max-new-tokens`` each (greedy), through ``--batch-sizes`` slots of the
bundled model in float32, speculative. Arms: ``before`` (the engine at ``--before``: each admission
prefilled in its own right-padded ``[rows, T]`` forwards before the step's cycle), ``flat`` (this
engine at its default token budget) and ``flat_budget`` (this engine at ``--budget`` tokens a step).

Reported per arm: the prefill's token positions (``EngineStats.prefill_token_slots``; for the old
engine counted at its prefill forwards' inputs) ÷ the prompt tokens it had to compute, all forward
positions, tokens/s (median of ``--reps`` interleaved rounds after a warm-up), and the longest and
99th-percentile step among the steps in which rows were decoding (how long a decoding row waits for
its next tokens while prompts are admitted). Completions must be identical across arms (checked).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy as np
import torch

from jobs.bench import ab, common
from jobs.bench.common import med


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``--rows`` prompts, lengths log-uniform in [min_len, max_len - new tokens] (seeded)."""
    rng = np.random.default_rng(args.seed)
    top = args.max_len - args.max_new_tokens
    lengths = np.exp(rng.uniform(np.log(args.min_len), np.log(top), args.rows)).astype(int)
    return [rng.integers(1, vocab - 2, n).tolist() for n in lengths]


@contextmanager
def prefill_positions(pkg, model):
    """Count the token positions the old engine's prefill forwards take (``counted[0]``)."""
    kernels = pkg.engine.device.kernels
    inner, forward, counted, inside = kernels.prompt_states, model.forward_cached, [0], [False]

    def states(*a, **kw):
        inside[0] = True
        try:
            return inner(*a, **kw)
        finally:
            inside[0] = False

    def cached(input_ids, *a, **kw):
        if inside[0]:
            counted[0] += input_ids.numel()
        return forward(input_ids, *a, **kw)
    kernels.prompt_states, model.forward_cached = states, cached
    try:
        yield counted
    finally:
        kernels.prompt_states, model.forward_cached = inner, forward


def run_arm(pkg, engine, prompts: list[list[int]], max_new: int, counted: list[int] | None) -> dict:
    """Every prompt through ``engine`` by hand-stepping → positions, step times, tokens/s, ids."""
    engine.reset()
    params = pkg.SamplingParams(temperature=0.0, max_new_tokens=max_new)
    before, start, counted_before = engine.stats, time.perf_counter(), counted[0] if counted else 0
    ids = [engine.add_request(p, params) for p in prompts]
    done, steps = {}, []
    while engine.has_unfinished_requests():
        decoding = engine.num_running > 0
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t)
        done.update((o.request_id, o) for o in outs)
    seconds, stats = time.perf_counter() - start, engine.stats - before
    computed = stats.prefill_tokens + stats.recomputed_tokens
    slots = counted[0] - counted_before if counted else stats.prefill_token_slots
    return {"tokens_per_s": sum(len(o.token_ids) for o in done.values()) / seconds,
            "prompt_tokens_computed": computed, "prefill_token_slots": slots,
            "prefill_slots_per_prompt_token": slots / computed,
            "forward_token_slots": getattr(stats, "forward_token_slots", None),
            "decoding_step_ms_max": 1e3 * max(steps), "decoding_step_ms_p99": 1e3 * float(np.percentile(steps, 99)),
            "ids": [done[i].token_ids for i in ids]}


def run(args: argparse.Namespace) -> dict:
    """The three arms per batch size, interleaved → the report (printed as it goes)."""
    import orthrus as new_pkg
    old_pkg = ab.load_before(args.before)
    models = {"old": old_pkg.OrthrusForCausalLM.from_pretrained(args.model, dtype=torch.float32),
              "new": new_pkg.OrthrusForCausalLM.from_pretrained(args.model, dtype=torch.float32)}
    prompts = workload(args, models["new"].config.vocab_size)
    report = {**ab.describe(args.before), "rows": args.rows, "min_len": args.min_len, "max_len": args.max_len,
              "max_new_tokens": args.max_new_tokens, "budget": args.budget, "reps": args.reps,
              "prompt_tokens": sum(map(len, prompts)), "results": {}}
    for b in common.batch_sizes(args, "16"):
        engines = {"before": ab.make_engine(old_pkg, models["old"], b, args.max_len),
                   "flat": new_pkg.OrthrusEngine(models["new"], max_batch_size=b, max_seq_len=args.max_len,
                                                 static_shapes=False),
                   "flat_budget": new_pkg.OrthrusEngine(models["new"], max_batch_size=b, max_seq_len=args.max_len,
                                                        static_shapes=False, max_num_batched_tokens=args.budget)}
        with prefill_positions(old_pkg, models["old"]) as counted:
            arms = {name: (lambda name=name: run_arm(old_pkg if name == "before" else new_pkg, engines[name], prompts,
                                                     args.max_new_tokens, counted if name == "before" else None))
                    for name in engines}
            r = common.rounds(arms, args.reps)
        cell = {name: {k: (med(r.samples[name], k) if k in ("tokens_per_s", "decoding_step_ms_max",
                                                               "decoding_step_ms_p99") else r.samples[name][-1][k])
                       for k in r.samples[name][-1] if k != "ids"} for name in engines}
        cell["identical"] = r.ids["before"][-1] == r.ids["flat"][-1] == r.ids["flat_budget"][-1]
        report["results"][f"B={b}"] = cell
        for name in engines:
            c = cell[name]
            print(f"B={b:<3} {name:<12} prefill slots / prompt token {c['prefill_slots_per_prompt_token']:.2f}, "
                  f"{c['tokens_per_s']:.0f} tok/s, decoding step max {c['decoding_step_ms_max']:.0f} ms "
                  f"(p99 {c['decoding_step_ms_p99']:.0f})", flush=True)
        print(f"B={b:<3} completions identical: {cell['identical']}", flush=True)
    return report


def add_args(ap) -> None:
    """Workload shape, the budget arm and the old engine's ref."""
    ap.add_argument("--before", default="f000003", help="git ref of the padded-prefill engine")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048, help="max_seq_len (the bundled model's limit)")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens of the budget arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.set_defaults(batch_sizes="16", max_new_tokens=16, reps=3)


def main(args: argparse.Namespace) -> None:
    """The flat-step report → ``bench-results/flat.json``."""
    common.set_threads(args)
    common.write_report(args, run(args))
