"""What every workload of ``python -m jobs.bench`` shares: the command line (the shared arguments;
each workload module adds only its own through ``add_args``), model and prompt loading, timing one
``generate``, interleaved warm-up + timed rounds, the median / pair-ratio helpers and where results go.

Imports torch and transformers only (no pipeline, no Ray): ``jobs/gpu_check.py`` imports the speed
workload, and with it this module, on a bare GPU image.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = "bench-results"
# workload → its module (imported only when it runs: several need the job's stack)
WORKLOADS = {"speed": "speed", "logprobs": "logprobs", "vocab": "vocab", "prefix": "prefix", "ab": "ab",
             "structured": "structured", "short": "short", "scale": "scale", "storage": "storage",
             "reasoning": "reasoning", "paged": "paged", "prefix_grouping": "prefix_grouping", "flat": "flat",
             "verify": "verify", "compiled": "compiled"}
DESCRIPTION = """Benchmarks: python -m jobs.bench [workload] [options] (--only WORKLOAD: the same).

    speed       (default) Orthrus vs our AR mode vs transformers generate, per batch size; on CPU
                with --job also the job around the engine (Ray job, audit, storage, scale)
    logprobs    what per-token logprobs cost        vocab       top-k / top-p at Qwen3's vocabulary
    prefix      prefix cache and short outputs      ab          the engine at a git ref vs the working tree's
    structured  grammar constraints' cost           short       1-token rows: the job vs the bare engine
    scale       the job around the engine at scale  storage     the job on local disk vs S3 on loopback
    reasoning   thinking on with a JSON schema: speculative ÷ AR, constrained ÷ free
    paged       the paged KV cache: rows in flight at a fixed pool vs the static layout's
    prefix_grouping  rows ordered by prompt tokens (per window, global) vs shuffled: prefill vs the ideal
    flat        the flat step: prefill positions per prompt token and decoding rows' waits vs a git ref
    verify      a verify budget per cycle: verified ÷ accepted drafts, tokens per cycle and tok/s vs all drafts
    compiled    engine.compile vs eager: tok/s per B and mode, ops per AR step and cycle, compile cold and warm

Results: bench-results/<workload>.json (--out to write elsewhere); speed also bench-results/speed.png.
python -m jobs.bench WORKLOAD --help lists that workload's own options.
"""


def workload_module(name: str) -> ModuleType:
    """The module of workload ``name`` (``jobs.bench.<module>``)."""
    return importlib.import_module(f"jobs.bench.{WORKLOADS[name]}")


def workload_of(argv: Sequence[str]) -> str:
    """The workload an argv asks for: ``--only X`` / ``--only=X``, else a leading positional, else speed."""
    for i, a in enumerate(argv):
        if a == "--only" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--only="):
            return a.split("=", 1)[1]
    return argv[0] if argv and not argv[0].startswith("-") else "speed"


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The arguments every workload takes (a workload changes a default with ``ap.set_defaults``)."""
    ap.add_argument("workload", nargs="?", choices=list(WORKLOADS), default=None, help="default: speed")
    ap.add_argument("--only", choices=list(WORKLOADS), default=None, help="the workload (the older spelling)")
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards", help="held-out Parquet shards (prompt, reference)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", default=None, help="comma list of B (slots); each workload has its default")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds after a warm-up round")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--min-rows", type=int, default=16,
                    help="prompts per run: max(B, this); more than B flow through the B slots")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default; on a shared CPU one keeps others' load from "
                         "stalling torch's pool)")
    ap.add_argument("--job", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the Ray Data job parts of the workload (CPU)")
    ap.add_argument("--job-config", "--config", dest="job_config", default="examples/demo.yaml",
                    help="the job config the bench's overrides apply to")
    ap.add_argument("--out", default=None, help=f"the report (default {RESULTS}/<workload>.json)")
    ap.add_argument("--results-dir", default=str(REPO / RESULTS), help="where reports go without --out")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The shared arguments and the chosen workload's own → one namespace (``args.workload`` set)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = workload_of(argv)
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    ap = argparse.ArgumentParser(prog="python -m jobs.bench", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    module = workload_module(name)
    module.add_args(ap.add_argument_group(f"{name} workload ({module.__name__})", module.__doc__.splitlines()[0]))
    args = ap.parse_args(argv)
    if {args.workload, args.only} - {None, name}:
        ap.error(f"one workload, first or as --only (asked for {args.workload!r} and --only {args.only!r})")
    args.workload = name
    return args


def results_path(args: argparse.Namespace, suffix: str = ".json") -> Path:
    """Where the workload's report goes: ``--out``, else ``<results-dir>/<workload>.json``
    (``suffix`` swaps the extension: the speed plot sits next to its JSON)."""
    path = Path(args.out) if args.out else Path(args.results_dir) / f"{args.workload}.json"
    return path.with_suffix(suffix)


def write_report(args: argparse.Namespace, report: dict) -> Path:
    """Write the report as JSON where ``results_path`` says → that path."""
    path = results_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}", flush=True)
    return path


def batch_sizes(args: argparse.Namespace, default: str) -> list[int]:
    """``--batch-sizes`` (or the workload's ``default``) as ints."""
    return [int(x) for x in (args.batch_sizes or default).split(",") if x.strip()]


def set_threads(args: argparse.Namespace) -> None:
    """``torch.set_num_threads(--threads)`` unless 0 (torch's default)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def load_model(path: str, dtype: torch.dtype = torch.float32):
    """The checkpoint at ``path`` as an ``OrthrusForCausalLM`` (float32: the CPU benches' dtype)."""
    from orthrus import OrthrusForCausalLM
    return OrthrusForCausalLM.from_pretrained(path, dtype=dtype)


def load_prompts(model_dir: str, prompts_dir: str) -> tuple[object, list[list[int]]]:
    """(the model's tokenizer, the held-out prompts as token ids)."""
    from transformers import AutoTokenizer

    from jobs.prompt_ids import load_prompt_ids
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, load_prompt_ids(tok, prompts_dir)


def sync_of(engine) -> Callable[[], None]:
    """A device sync for timing the engine's model (a no-op on CPU)."""
    cuda = next(engine.model.parameters()).is_cuda
    return torch.cuda.synchronize if cuda else (lambda: None)


def time_generate(engine, prompts: list[list[int]], params, speculative=None) -> tuple[float, list]:
    """One ``engine.generate`` → (seconds, its outputs); on a GPU synchronised on both sides."""
    sync = sync_of(engine)
    sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, speculative=speculative)
    sync()
    return time.perf_counter() - start, outs


def rotated(names: Sequence, rep: int) -> list:
    """``names`` rotated by ``rep``: in round ``rep`` every run goes first in turn, so a drift in the
    machine's load hits every run alike."""
    k = rep % len(names)
    return list(names[k:]) + list(names[:k])


class Rounds(NamedTuple):
    """What ``rounds`` measured: the timed cells and the warm-up cells by name, and the token ids
    every run of a name gave (round 0 included), in order (cells carrying ``ids`` lose them)."""

    samples: dict[str, list[dict]]
    first: dict[str, dict]
    ids: dict[str, list]

    def repeatable(self, name: str) -> bool:
        """Whether every run of ``name`` gave the same tokens."""
        return all(x == self.ids[name][0] for x in self.ids[name])


def rounds(runs: dict[str, Callable[[], dict]], reps: int, rotate: bool = True, warmup: bool = True) -> Rounds:
    """``reps`` timed rounds of every ``runs[name]()`` (after one warm-up round with ``warmup``),
    interleaved, in rotating order with ``rotate``."""
    names = list(runs)
    out = Rounds({n: [] for n in names}, {}, {n: [] for n in names})
    for rep in range(reps + 1 if warmup else reps):
        for name in (rotated(names, rep) if rotate else names):
            cell = runs[name]()
            if "ids" in cell:
                out.ids[name].append(cell.pop("ids"))
            if warmup and rep == 0:
                out.first[name] = cell
            else:
                out.samples[name].append(cell)
    return out


def host_reads_per_iteration(engine, run: Callable[[], object]) -> float:
    """Device→host reads per engine iteration while ``run()`` drives ``engine`` (the budget of an
    unconstrained iteration is 1)."""
    from orthrus.testing.host_syncs import count_host_reads, host_reads
    before = engine.stats.iterations
    with count_host_reads() as reads:
        run()
    return host_reads(reads) / max(1, engine.stats.iterations - before)


def med(cells: list[dict], key: str) -> float:
    """The median of ``key`` over ``cells``."""
    return statistics.median(c[key] for c in cells)


def pair_ratio(a: list[dict], b: list[dict], key: str) -> float:
    """Median over rounds of a[i][key] ÷ b[i][key] (same round: the same machine load)."""
    return statistics.median(x[key] / y[key] for x, y in zip(a, b))


def median_cell(cells: list[dict]) -> dict:
    """Each key's median over ``cells`` (None where the first cell has None)."""
    return {k: (med(cells, k) if cells[0][k] is not None else None) for k in cells[0]}
