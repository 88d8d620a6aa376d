"""The paged KV cache: rows in flight at a fixed pool, against the static layout's at the same memory.

    python -m jobs.bench paged                 # writes bench-results/paged.json

A seeded workload of ``--rows`` prompts whose lengths are log-uniform in ``--min-len``…``--max-len``
tokens (random ids), ``--max-new-tokens`` each (greedy, ``min_tokens`` = it, so every row holds
its length), on the bundled model in float32. Two engines with the same KV memory, ``--static-slots``
rows at full length (``max_seq_len`` = the longest row):

    static   ``max_batch_size`` = static-slots: the pool holds exactly those slots at full length,
             so rows in flight are capped by the slots, as with the static layout before paging
    paged    the same pool, ``max_batch_size`` = ``--paged-slots``: rows take pages as they hold
             tokens, so as many run as their pages fit (preempting the newest when they outgrow it)

Reported per arm: rows in flight (median and mean over the steps while rows still wait; the tail
after the queue drains says nothing about capacity), pages held per row in flight against its
tokens (KV bytes proportional to tokens), preemptions, and steady tokens/s (the same steps; median
of ``--reps`` interleaved rounds after a warm-up). Completions must be identical across arms (checked).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from jobs.bench import common
from jobs.bench.common import med, pair_ratio
from orthrus import OrthrusEngine, SamplingParams


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``--rows`` prompts, lengths log-uniform in [min_len, max_len - new tokens] (seeded)."""
    rng = np.random.default_rng(args.seed)
    top = args.max_len - args.max_new_tokens
    lengths = np.exp(rng.uniform(np.log(args.min_len), np.log(top), args.rows)).astype(int)
    return [rng.integers(1, vocab - 2, n).tolist() for n in lengths]


def run_arm(engine: OrthrusEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Every prompt through ``engine`` by hand-stepping → in-flight samples, pages, timing, token ids."""
    engine.reset()
    before, start = engine.stats, time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done, flight, per_row = {}, [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if engine.num_waiting:                       # while input lasts: the capacity being used
            flight.append(engine.num_running)
            per_row.append(engine.kv_pages.in_use / max(1, engine.num_running))
        done.update((o.request_id, o) for o in outs)
    seconds, stats = time.perf_counter() - start, engine.stats - before
    tokens = sum(len(o.token_ids) for o in done.values())
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "rows_in_flight_median": statistics.median(flight) if flight else None,
            "rows_in_flight_mean": float(np.mean(flight)) if flight else None,
            "pages_per_row_in_flight": float(np.mean(per_row)) if per_row else None,
            "preemptions": stats.preemptions, "recomputed_tokens": stats.recomputed_tokens,
            "ids": [done[i].token_ids for i in ids]}


def add_args(ap) -> None:
    """Its own: the workload's lengths and size, the two arms' slots; 3 reps, 16 new tokens."""
    ap.add_argument("--rows", type=int, default=160, help="prompts in the workload")
    ap.add_argument("--min-len", type=int, default=64, help="shortest row (tokens)")
    ap.add_argument("--max-len", type=int, default=4096, help="longest row (tokens): max_seq_len")
    ap.add_argument("--static-slots", type=int, default=8, help="rows the pool holds at full length")
    ap.add_argument("--paged-slots", type=int, default=64, help="the paged arm's cap on rows in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.set_defaults(reps=3, max_new_tokens=16, threads=1)


def main(args: argparse.Namespace) -> None:
    """Both arms, interleaved rounds → ``bench-results/paged.json``; completions differing raises."""
    common.set_threads(args)
    model = common.load_model(args.model)
    prompts = workload(args, int(model.config.vocab_size))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, min_tokens=args.max_new_tokens)
    static = OrthrusEngine(model, max_batch_size=args.static_slots, max_seq_len=args.max_len, speculative=False)
    pool = static.kv_pages.total * static.kv_pages.page_size          # the static arm's pool, in tokens
    paged = OrthrusEngine(model, max_batch_size=args.paged_slots, max_seq_len=args.max_len, speculative=False,
                          kv_cache_tokens=pool)
    arms = {"static": static, "paged": paged}
    r = common.rounds({name: (lambda e=e: run_arm(e, prompts, params)) for name, e in arms.items()}, args.reps)
    s = r.samples
    lengths = [len(p) + args.max_new_tokens for p in prompts]
    report = {"model": args.model, "threads": torch.get_num_threads(), "reps": args.reps, "rows": args.rows,
              "row_tokens": {"min": min(lengths), "mean": float(np.mean(lengths)), "max": max(lengths)},
              "pool_tokens": pool, "page_size": paged.kv_pages.page_size,
              "kv_bytes_per_token": static.cache.bytes_per_token,
              "arms": {name: {k: med(s[name], k) for k in ("tokens_per_s", "rows_in_flight_median",
                                                          "rows_in_flight_mean", "pages_per_row_in_flight",
                                                          "preemptions", "recomputed_tokens")} for name in arms}}
    a = report["arms"]
    report["rows_in_flight_paged_over_static"] = a["paged"]["rows_in_flight_median"] / a["static"]["rows_in_flight_median"]
    report["tokens_per_s_paged_over_static"] = {"medians": a["paged"]["tokens_per_s"] / a["static"]["tokens_per_s"],
                                                "pairs": pair_ratio(s["paged"], s["static"], "tokens_per_s")}
    # pages a row holds vs its tokens: pages per row in flight x page size / (mean row tokens + a block)
    report["paged_pages_per_row_over_tokens"] = (a["paged"]["pages_per_row_in_flight"] * paged.kv_pages.page_size
                                                 / (np.mean(lengths) + paged.block_size))
    report["completions_identical"] = r.ids["static"] == r.ids["paged"]
    print(f"rows in flight: static {a['static']['rows_in_flight_median']}, paged {a['paged']['rows_in_flight_median']} "
          f"(x{report['rows_in_flight_paged_over_static']:.2f}); tokens/s paged/static "
          f"x{report['tokens_per_s_paged_over_static']['medians']:.2f}; preemptions {a['paged']['preemptions']}; "
          f"completions identical: {report['completions_identical']}", flush=True)
    common.write_report(args, report)
    if not report["completions_identical"]:
        raise SystemExit("paged bench: the arms' completions differ")
