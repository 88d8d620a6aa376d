"""The one script to run when a session is lent a GPU (an H100 or H200, 8 minutes of it):

    python3 -m jobs.gpu_check --dry-run                      # here, first: the plan as JSON, stamps the commit
    python3 -m jobs.gpu_check --out "$OUT"                   # on the device: budget 480 s (--budget-s)
    python3 -m jobs.gpu_check --device cpu --out /tmp/gc     # smoke run, tiny sizes (tests/engine/test_gpu_check.py)
    python3 -m jobs.gpu_check --only costs_graphs,sync_debug --out "$OUT"   # a rerun of some steps

The report records the commit it ran: ``git rev-parse HEAD`` where the tree has its git directory,
else the stamp ``--dry-run`` wrote into the tree (``GPU_CHECK_COMMIT``; the device machine gets
a copy of the working tree without ``.git``). Results go to ``gpu-check/<date>/`` (docs/performance.md
summarises each run).

The exactness steps live in ``jobs/gpu_exactness.py``, the cost steps in ``jobs/gpu_costs.py``.
Imports torch, transformers, pyarrow, ``orthrus`` and ``jobs.bench.speed`` only: nothing from
``pipeline`` (pydantic, Ray), which a bare GPU image lacks. Steps run in order; one is skipped, with
the reason, when the budget has less time left than its estimate or it cannot run here (CUDA only,
no flash-attn, an engine without ``compile``); one that raises is recorded with its error and the
next runs; a timer interrupts one that outruns the budget. ``<out>/gpu-check.json`` is rewritten
(temp + rename) after EVERY step, the cost grids after every batch size (``costs-<mode>.json``), so
a run stopped early still returns what it measured.

| step                       | what                                                                 | s, est. |
|----------------------------|----------------------------------------------------------------------|---------|
| sdpa_backends              | SDPA flags, priority; the backend the engine's shapes get            |   4     |
| fp32_graphs_vs_eager       | fp32 bundled model: CUDA graphs vs eager, token for token            |  25     |
| fp32_compiled_vs_eager     | fp32: compiled + graphs vs eager (greedy spec and AR, sampled), spec == AR | 35 |
| paged_preemption           | fp32, graphs: a KV pool of ~1 row (preemption) vs a roomy one        |  12     |
| bf16_speculative_vs_ar     | what the job's lossless audit reports on a bf16 run                  |  12     |
| bf16_flash_graphs_vs_eager | flash + graphs vs eager SDPA (with flash-attn only)                  |  20     |
| sync_debug                 | one decode iteration under ``set_sync_debug_mode("warn")``           |   8     |
| bench_model                | bf16 Qwen3-1.7B-shaped random weights + the HF twin                  |  30     |
| profile_ar_step            | profiler, AR steps at B = 8, eager and graphs: kernels/step, top 10, host gap, trace | 20 |
| costs_graphs               | ms per AR step and per cycle, R, for B in {1..256} x K in {8, 16, 32} |  70     |
| costs_compiled             | the same, compiled (compile time included)                           |  90     |
| costs_eager                | the same, eager (no graphs): the baseline                            |  40     |
| sampling_cost              | an AR step sampling (T 0.8, top-p 0.95) / greedy at V = 151,936, B = 8, 64 | 14 |
| bench_b8 / b64             | generation: orthrus, auto (graphs), ar, hf ``generate``; 64 new tokens | 30 / 30 |
| bench_verify               | a K = 8 cycle at B = 64, 128: every draft vs 3/8, 2/8 (pinned)       |  40     |

The estimates come from the first H200 run (2026-12-04: 239 s for its 16 steps; an eager forward of
the 1.7B shape was launch-bound, 25-45 ms at any B and T; an AR step replayed from a CUDA graph ~5x
faster) with a margin for first-use costs; the compiled steps' include compiling. Random weights
accept ~no drafts: only costs mean anything in the bench and cost steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import warnings
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import torch
import transformers

from jobs.bench import common
from jobs.bench import speed as bench
from jobs import gpu_costs
from jobs.bench import verify as verify_bench
from jobs.gpu_budget import STAMP, Budget, Step, commit, guard, write_json
from jobs.gpu_exactness import (bf16_flash_graphs_vs_eager, bf16_speculative_vs_ar, fp32_compiled_vs_eager,
                                fp32_graphs_vs_eager, load_prompts, paged_preemption)
from orthrus import EngineSettings, OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.testing.host_syncs import count_host_reads
from orthrus.model import flash

# Per device: exactness prompts and new tokens; bench batch sizes, new tokens, timed repetitions; the
# cost grid (batch sizes x block sizes, timed steps per cell), the profiled and the sampling batch sizes.
SIZES = {"cuda": {"n": 24, "max_new": 64, "batch_sizes": (8, 64), "bench_new": 64, "reps": 2,
                  "cost_batch_sizes": (1, 8, 32, 64, 128, 256), "cost_blocks": (8, 16, 32), "cost_steps": 5,
                  "profile_b": 8, "sampling_batch_sizes": (8, 64)},
         "cpu": {"n": 10, "max_new": 12, "batch_sizes": (1, 2), "bench_new": 8, "reps": 1,
                 "cost_batch_sizes": (1, 2), "cost_blocks": (2, 4), "cost_steps": 2,
                 "profile_b": 2, "sampling_batch_sizes": (2,)}}
# Seconds per step at CUDA's sizes (the 2026-12-04 H200 run's timings with a margin; the compiled
# steps' figures include compiling): they sum to at most the default 480 s budget.
ESTIMATE_S = {"sdpa_backends": 4, "fp32_graphs_vs_eager": 25, "fp32_compiled_vs_eager": 35, "paged_preemption": 12,
              "bf16_speculative_vs_ar": 12, "bf16_flash_graphs_vs_eager": 20, "sync_debug": 8, "bench_model": 30,
              "profile_ar_step": 20, "costs_graphs": 70, "costs_compiled": 90, "costs_eager": 40,
              "sampling_cost": 14, "bench_b8": 30, "bench_b64": 30, "bench_verify": 40}
# The engine's SDPA calls in the bench's shape (H = 16, Hk = 8, D = 128) as (rows, queries, keys),
# always masked with grouped KV heads: eager keys rounded up to 128s, static ones the whole capacity.
SDPA_SHAPES = {"ar_step_b8": (8, 1, 256), "cycle_b8": (8, 32, 384), "cycle_b128": (128, 32, 384),
               "static_cycle_b8": (8, 32, 1056), "prefill_b8": (8, 200, 256)}


def _sdpa_choice(device: torch.device, dtype: torch.dtype, b: int, t: int, keys: int) -> dict:
    """The backend ``torch._fused_sdp_choice`` picks for one engine-shaped call, and why flash and
    memory-efficient attention can or cannot take it (their debug warnings)."""
    q = torch.zeros((b, 16, t, 128), device=device, dtype=dtype)
    kv = torch.zeros((b, 8, keys, 128), device=device, dtype=dtype)
    mask = torch.ones((b, 1, t, keys), device=device, dtype=torch.bool)
    pick = torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=None,
                                   enable_gqa=True)
    out = {"choice": torch.nn.attention.SDPBackend(pick).name}
    params = torch.nn.attention.SDPAParams(q, kv, kv, mask, 0.0, False, True)
    for name in ("flash", "efficient"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = getattr(torch.backends.cuda, f"can_use_{name}_attention")(params, True)
        out[f"can_use_{name}"] = {"ok": ok, "why": [str(w.message)[:300] for w in caught]}
    return out


def sdpa_backends(device: torch.device) -> dict:
    """Which SDPA backends are on, in what order, and which one the engine's shapes get."""
    cuda = torch.backends.cuda
    info = {name: guard(lambda name=name: getattr(cuda, name)())
            for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")}
    info["priority_order"] = guard(lambda: [torch.nn.attention.SDPBackend(int(b)).name
                                             for b in torch._C._get_sdp_priority_order()])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info["engine_shapes"] = {name: guard(lambda s=shape: _sdpa_choice(device, dtype, *s))
                             for name, shape in SDPA_SHAPES.items()}
    return info


@contextmanager
def _sync_warnings(device: torch.device):
    """Collect what ``set_sync_debug_mode("warn")`` reports in the block (CUDA only); the mode is
    put back afterwards."""
    found: dict = {}
    if device.type != "cuda":
        found["sync_debug_mode"] = "skipped: needs CUDA"
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    messages = [str(w.message) for w in caught]
    sync = [m for m in messages if "synchroniz" in m]
    found.update(sync_warnings=len(sync), other_warnings=len(messages) - len(sync),
                 messages=sorted(set(m[:300] for m in messages))[:10])


def sync_debug(model_dir: str, prompts, device: str) -> dict:
    """One steady-state decode iteration, eager and replayed from a graph: its host transfers (the
    read budget is 1) and, on CUDA, the synchronising calls the sync debug mode reports."""
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    report = {}
    for name, static in (("eager", False), ("graphs", True)):
        engine = OrthrusEngine(model, max_batch_size=4, max_seq_len=256, attention="sdpa", static_shapes=static)
        for p in prompts[:4]:
            engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=64))
        engine.step()
        engine.step()            # prefill, then the iteration that captures; the next one replays
        with count_host_reads() as reads, _sync_warnings(engine.device) as found:
            engine.step()
        report[name] = {"host_transfers": dict(reads), **found}
    return report


class Check(Budget):
    """The GPU check's steps under one wall-clock budget, keeping ``gpu-check.json`` current."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.sizes = SIZES[self.device.type]
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        report = {**_environment(self.device), "budget_s": args.budget_s, "finished": False, "steps": {}}
        super().__init__(args.budget_s, ESTIMATE_S, self.out / "gpu-check.json", report)
        self.bench: dict = {}      # the bench steps' shared model, prompts and partial reports

    @cached_property
    def prompts(self) -> list[list[int]]:
        return load_prompts(self.args.model, self.args.prompts, self.sizes["n"])

    def bench_args(self) -> argparse.Namespace:
        """The trimmed bench: rows = B (one wave), few repetitions, the engine's defaults (graphs on CUDA)."""
        args = common.parse_args(["speed", "--device", self.device.type, "--model", self.args.model, "--prompts",
                                  self.args.prompts, "--max-new-tokens", str(self.sizes["bench_new"]), "--reps",
                                  str(self.sizes["reps"]), "--min-rows", "1", "--no-job", "--attention", "auto"])
        args.cuda_graphs = None
        return args

    def bench_model(self) -> dict:
        args = self.bench_args()
        torch.manual_seed(0)
        model, prompts = bench.gpu_model() if self.device.type == "cuda" else bench.cpu_model(args)
        self.bench.update(model=model, prompts=prompts, hf=bench.hf_twin(model, args.device))
        head = {"device": args.device, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                "block_size": model.block_size, "reps": args.reps, "rows": "B"}
        self.bench["report"] = {**head, "results": {}}
        return {"parameters": sum(p.numel() for p in model.parameters()), "prompts": len(prompts), **_cuda_mib()}

    def costs(self, mode: str) -> dict:
        """ms per AR step and per cycle, R, AR tokens/s over the cost grid (``gpu_costs.step_costs``),
        each batch size's cell written to ``costs-<mode>.json`` as it lands (a step cut by the budget
        still returns its cells)."""
        sizes, cells = self.sizes, {}
        for b in sizes["cost_batch_sizes"]:
            cells.update(guard_cell(lambda b=b: gpu_costs.step_costs(
                self.bench["model"], self.bench["prompts"], (b,), sizes["cost_blocks"], mode, sizes["cost_steps"]), b))
            write_json(self.out / f"costs-{mode}.json", {"mode": mode, **_cuda_mib(), "cells": cells})
        return cells

    def profile_ar_step(self) -> dict:
        return gpu_costs.profile_ar_step(self.bench["model"], self.bench["prompts"], self.sizes["profile_b"],
                                         self.sizes["cost_steps"], self.out)

    def sampling_cost(self) -> dict:
        return gpu_costs.sampling_cost(self.bench["model"], self.bench["prompts"], self.sizes["sampling_batch_sizes"],
                                       self.sizes["cost_steps"])

    def bench_batch(self, b: int) -> dict:
        """Generation at B rows: orthrus, auto (with graphs on CUDA), our AR and HF ``generate``."""
        # At B = 1 (the CPU smoke run), HF generate and the auto policy's probing tell the least.
        modes = ["orthrus", "ar"] if b == 1 else list(bench.MODES)
        st = self.bench
        with warnings.catch_warnings(record=True) as caught:     # a failed capture warns (graphs.py)
            warnings.simplefilter("always")
            cells = bench.bench_batch(b, self.bench_args(), st["model"], st["prompts"], st["hf"], modes)
        cells["warnings"] = sorted({str(w.message)[:300] for w in caught})[:10]
        bench.print_row(b, cells)
        st["report"]["results"][str(b)] = cells
        self._save_bench()
        return cells

    def bench_verify(self) -> dict:
        """A cycle's cost verifying every draft vs a pinned budget (``jobs/bench/verify.py``)."""
        cuda = self.device.type == "cuda"
        costs = verify_bench.cycle_costs(self.bench["model"], self.bench["prompts"], [64, 128] if cuda else [2],
                                         8 if cuda else self.bench["model"].block_size, 32 if cuda else 4,
                                         self.sizes["reps"])
        self.bench["report"]["verify_budget"] = costs
        self._save_bench()
        return costs

    def _save_bench(self) -> None:
        if self.bench["report"].get("results") or self.bench["report"].get("verify_budget"):
            write_json(self.out / f"bench-{self.device.type}.json", {**self.bench["report"], **_cuda_mib()})


def guard_cell(fn, b: int) -> dict:
    """One batch size's cost cell, or its error (out of memory at B = 256 must not lose B = 128)."""
    try:
        return fn()
    except Exception as err:      # noqa: BLE001 - recorded; the next batch size runs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {f"B={b}": {"error": f"{type(err).__name__}: {err}"[:500]}}


def compile_skipped(device: str) -> str | None:
    """Why the ``compiled`` steps do not run here, or None: an engine without the setting, or the CPU
    smoke run (a cold compile costs a minute of a small CPU; tests/engine/test_compiled_step.py runs
    these steps' code with the pieces its other tests compiled)."""
    if "compile" not in {f.name for f in dataclasses.fields(EngineSettings)}:
        return "this engine has no compile setting (EngineSettings.compile)"
    return "the CPU smoke run skips the compiled steps (their code: test_compiled_step.py)" if device == "cpu" else None


def _cuda_mib() -> dict:
    return {"peak_cuda_mib": torch.cuda.max_memory_allocated() / 2 ** 20} if torch.cuda.is_available() else {}


def _environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    gib = guard(lambda: torch.cuda.get_device_properties(device).total_memory / 2 ** 30) if cuda else None
    return {"device": guard(lambda: torch.cuda.get_device_name(device)) if cuda else "cpu", "memory_gib": gib,
            "torch": torch.__version__, "transformers": transformers.__version__, "cuda_runtime": torch.version.cuda,
            "python": sys.version.split()[0], "sizes": SIZES[device.type],
            "flash_attn": flash.unavailable_reason(device, torch.bfloat16) or "importable", "commit": commit()}


def dry_run(args: argparse.Namespace, stamp_path: Path = STAMP) -> dict:
    """Print the plan as JSON (each step and its estimated seconds at the device's sizes, their sum,
    the budget, the commit) and stamp the commit at ``stamp_path`` (the tree's ``GPU_CHECK_COMMIT``:
    the device machine's copy has no ``.git``) → the plan."""
    check = Check.__new__(Check)          # the steps' names only: no output directory, no report
    check.args, check.device, check.sizes, check.bench = args, torch.device(args.device), SIZES[args.device], {}
    names = [s.name for s in selected(steps(check), args.only) if s.why_not is None or s.why_not() != "not in --only"]
    stamp = commit()
    if stamp is not None:
        stamp_path.write_text(stamp + "\n")
    plan = {"steps": [{"name": n, "estimate_s": ESTIMATE_S.get(n, 0)} for n in names],
            "total_s": sum(ESTIMATE_S.get(n, 0) for n in names), "budget_s": args.budget_s, "commit": stamp,
            "out": args.out}
    print(json.dumps(plan, indent=1), flush=True)
    return plan


def steps(check: Check) -> list[Step]:
    """Every step, in the order of the module docstring's table."""
    a, dev, sizes = check.args, check.args.device, check.sizes

    def has_model() -> str | None:
        return "--skip-bench" if a.skip_bench else (None if "model" in check.bench else "bench_model did not run")

    def compiled() -> str | None:
        return compile_skipped(dev) or has_model()

    def exact(fn):
        return lambda: fn(a.model, check.prompts, dev, sizes["max_new"])
    out = [Step("sdpa_backends", lambda: sdpa_backends(check.device)),
           Step("fp32_graphs_vs_eager", exact(fp32_graphs_vs_eager)),
           Step("fp32_compiled_vs_eager", exact(fp32_compiled_vs_eager), lambda: compile_skipped(dev)),
           Step("paged_preemption", exact(paged_preemption)),
           Step("bf16_speculative_vs_ar", exact(bf16_speculative_vs_ar)),
           Step("bf16_flash_graphs_vs_eager", exact(bf16_flash_graphs_vs_eager),
                lambda: flash.unavailable_reason(check.device, torch.bfloat16)),
           Step("sync_debug", lambda: sync_debug(a.model, check.prompts, dev)),
           Step("bench_model", check.bench_model, lambda: "--skip-bench" if a.skip_bench else None),
           Step("profile_ar_step", check.profile_ar_step, has_model),
           Step("costs_graphs", lambda: check.costs("graphs"), has_model),
           Step("costs_compiled", lambda: check.costs("compiled"), compiled),
           Step("costs_eager", lambda: check.costs("eager"), has_model),
           Step("sampling_cost", check.sampling_cost, has_model)]
    out += [Step(f"bench_b{b}", lambda b=b: check.bench_batch(b), has_model) for b in sizes["batch_sizes"]]
    return out + [Step("bench_verify", check.bench_verify, has_model)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"gpu-check/{datetime.date.today().isoformat()}",
                    help="the report's directory (default gpu-check/<today>)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the smoke run at tiny sizes, CUDA-only parts recorded as skipped")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall clock for all steps; a step estimated to need more than is left is skipped")
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--only", default="",
                    help="comma-separated step names (a rerun of some steps); the others are recorded as skipped")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the steps and their estimated seconds, stamp the commit into the tree, run nothing")
    return ap.parse_args(argv)


def selected(all_steps: list[Step], only: str) -> list[Step]:
    """``all_steps`` with those not named in ``--only`` (when given) skipped, saying so."""
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = names - {s.name for s in all_steps}
    if unknown:
        raise SystemExit(f"jobs.gpu_check: --only names unknown steps {sorted(unknown)}")
    if not names:
        return all_steps
    return [s if s.name in names else s._replace(why_not=lambda: "not in --only") for s in all_steps]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("jobs.gpu_check: no CUDA device here; pass --device cpu for the smoke run")
    check = Check(args)
    check.save()                 # the environment first, should the first step never return
    for step in selected(steps(check), args.only):
        check.run(step)
    check.report["finished"] = True
    check.save()
    statuses = {name: s["status"] for name, s in check.report["steps"].items()}
    print(f"[gpu_check] wrote {check.out / 'gpu-check.json'} in {check.report['elapsed_s']:.0f} s: {statuses}",
          flush=True)


if __name__ == "__main__":
    main()
