"""What per-token logprobs cost the engine: tokens/s with ``logprobs`` None, 0 and 5, per batch size.

    python -m jobs.bench logprobs              # writes bench-results/logprobs.json

Speculative mode, greedy, the bundled model in float32 on the held-out prompts. The three settings
run in one process, interleaved (in rotating order), on the same prompts (the first repetition is a
warm-up); each cell is the median of ``reps``. On a shared CPU, ``--threads 1`` keeps other
processes' load from stalling torch's thread pool (which swamps a few-percent difference).
Reported: tokens/s per setting and its ratio to the run without logprobs (``ratio_0``,
``ratio_5``), and device→host reads per iteration with logprobs on (the budget stays 1). Every setting must generate the same tokens: logprobs never change a sample.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from jobs.bench import common
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams

SETTINGS: tuple[int | None, ...] = (None, 0, 5)


def _label(logprobs: int | None) -> str:
    return "none" if logprobs is None else str(logprobs)


def _run_once(engine: OrthrusEngine, prompts: list[list[int]], max_new: int, logprobs: int | None) -> dict:
    """One greedy speculative generate → tokens/s, tokens and the token ids."""
    seconds, outs = common.time_generate(engine, prompts, SamplingParams(max_new_tokens=max_new, logprobs=logprobs),
                                         speculative=True)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "ids": [o.token_ids for o in outs]}


def bench_batch(model: OrthrusForCausalLM, prompts: list[list[int]], b: int, reps: int, max_new: int) -> dict:
    """Interleaved repetitions of every setting at batch size ``b`` → medians and ratios."""
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=min(1024, model.config.max_position_embeddings),
                           static_shapes=False)
    rows = prompts[: max(b, 4)]
    # rotated: drift hits every setting; round 0 a warm-up
    r = common.rounds({_label(s): (lambda s=s: _run_once(engine, rows, max_new, s)) for s in SETTINGS}, reps)
    assert r.ids["none"][-1] == r.ids["0"][-1] == r.ids["5"][-1], "logprobs changed the generated tokens"
    cells: dict = {name: {"tokens_per_s": common.med(v, "tokens_per_s"), "tokens": v[-1]["tokens"]}
                   for name, v in r.samples.items()}
    for setting in SETTINGS[1:]:
        cells[f"ratio_{setting}"] = cells[_label(setting)]["tokens_per_s"] / cells["none"]["tokens_per_s"]
    cells["host_reads_per_iteration_logprobs_5"] = common.host_reads_per_iteration(
        engine, lambda: _run_once(engine, rows, max_new, 5))
    cells["rows"] = len(rows)
    return cells


def run(model_dir: str = "models/tiny-orthrus-py", batch_sizes: Sequence[int] = (1, 16), reps: int = 5,
        max_new_tokens: int = 64, prompts_dir: str = "examples/shards") -> dict:
    """Tokens/s with logprobs None / 0 / 5 at each batch size (speculative, greedy) → the report (printed)."""
    model = common.load_model(model_dir)
    prompts = common.load_prompts(model_dir, prompts_dir)[1]
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


def add_args(ap) -> None:
    """No arguments of its own (batch sizes default to 1,16)."""
    ap.set_defaults(batch_sizes="1,16")


def main(args: argparse.Namespace) -> None:
    """Run at ``--batch-sizes`` → ``bench-results/logprobs.json``."""
    common.set_threads(args)
    report = run(args.model, common.batch_sizes(args, "1,16"), args.reps, args.max_new_tokens, args.prompts)
    common.write_report(args, report)
