"""What per-token logprobs cost the engine: tokens/s with ``logprobs`` None, 0 and 5, per batch size.

    python -m jobs.bench --only logprobs       # writes bench_logprobs.json next to --out
    python -m jobs.bench_logprobs              # the same, printed

Speculative mode, greedy, the bundled model in float32 on the held-out prompts. The three settings
run in one process, interleaved (in rotating order), on the same prompts (the first repetition is a
warm-up); each cell is the median of ``reps``. On a shared CPU, ``--threads 1`` keeps other
processes' load from stalling torch's thread pool (which swamps a few-percent difference).
Reported: tokens/s per setting and its ratio to the run without logprobs (``ratio_0``,
``ratio_5``), and device→host reads per iteration with logprobs on (the budget stays 1). Every setting must generate the same tokens: logprobs never change a sample.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.testing.host_syncs import count_host_reads, host_reads

SETTINGS: tuple[int | None, ...] = (None, 0, 5)


def _label(logprobs: int | None) -> str:
    return "none" if logprobs is None else str(logprobs)


def _run_once(engine: OrthrusEngine, prompts: list[list[int]], max_new: int, logprobs: int | None
              ) -> tuple[float, int, list[list[int]]]:
    """One greedy speculative generate → (seconds, tokens, the token ids)."""
    params = SamplingParams(max_new_tokens=max_new, logprobs=logprobs)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, speculative=True)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs), [o.token_ids for o in outs]


def bench_batch(model: OrthrusForCausalLM, prompts: list[list[int]], b: int, reps: int, max_new: int) -> dict:
    """Interleaved repetitions of every setting at batch size ``b`` → medians and ratios."""
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=min(1024, model.config.max_position_embeddings),
                           static_shapes=False)
    rows = prompts[: max(b, 4)]
    samples: dict[str, list[float]] = {_label(s): [] for s in SETTINGS}
    tokens: dict[str, int] = {}
    ids: dict[str, list[list[int]]] = {}
    for rep in range(reps + 1):
        for setting in SETTINGS[rep % 3:] + SETTINGS[: rep % 3]:      # rotated: drift hits every setting
            seconds, n, got = _run_once(engine, rows, max_new, setting)
            tokens[_label(setting)], ids[_label(setting)] = n, got
            if rep:
                samples[_label(setting)].append(n / seconds)
    assert ids["none"] == ids["0"] == ids["5"], "logprobs changed the generated tokens"
    cells: dict = {name: {"tokens_per_s": statistics.median(v), "tokens": tokens[name]} for name, v in samples.items()}
    for setting in SETTINGS[1:]:
        cells[f"ratio_{setting}"] = cells[_label(setting)]["tokens_per_s"] / cells["none"]["tokens_per_s"]
    before = engine.stats.iterations
    with count_host_reads() as reads:
        _run_once(engine, rows, max_new, 5)
    cells["host_reads_per_iteration_logprobs_5"] = host_reads(reads) / (engine.stats.iterations - before)
    cells["rows"] = len(rows)
    return cells


def run(model_dir: str = "models/tiny-orthrus-py", batch_sizes: Sequence[int] = (1, 16), reps: int = 5,
        max_new_tokens: int = 64, prompts_dir: str = "examples/shards") -> dict:
    """Tokens/s with logprobs None / 0 / 5 at each batch size (speculative, greedy) → the report (printed)."""
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = load_prompt_ids(AutoTokenizer.from_pretrained(model_dir), prompts_dir)
    report: dict = {"model": model_dir, "threads": torch.get_num_threads(), "reps": reps,
                    "max_new_tokens": max_new_tokens, "block_size": model.block_size, "results": {}}
    for b in batch_sizes:
        cells = bench_batch(model, prompts, b, reps, max_new_tokens)
        report["results"][str(b)] = cells
        print(f"logprobs B={b:<3} " + " | ".join(f"{_label(s)}: {cells[_label(s)]['tokens_per_s']:.0f} tok/s"
                                                  for s in SETTINGS)
              + f" | ×(0)={cells['ratio_0']:.3f} ×(5)={cells['ratio_5']:.3f}"
              + f" | host reads/iteration={cells['host_reads_per_iteration_logprobs_5']:g}", flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default=None, help="also write the report here (JSON)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.model, [int(x) for x in args.batch_sizes.split(",")], args.reps, args.max_new_tokens,
                 args.prompts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
