"""The one script to run when a session is lent a GPU (an H200, about 10 minutes of it):

    python3 -m jobs.gpu_check --out "$OUT"                   # budget 480 s (--budget-s)
    python3 -m jobs.gpu_check --device cpu --out /tmp/gc     # smoke run, tiny sizes (tests/engine/test_gpu_check.py)
    python3 -m jobs.gpu_check --only fp32_graphs_vs_eager,sync_debug --out "$OUT"   # a rerun of some steps
    python3 -m jobs.gpu_check --dry-run                      # here, before the run: the plan and its
                                                             # estimated seconds; stamps the commit

The report records the commit it ran: ``git rev-parse HEAD`` where the tree has its git directory,
else the stamp ``--dry-run`` wrote into the tree (``GPU_CHECK_COMMIT``; the device machine gets
a copy of the working tree without ``.git``).

The exactness steps live in ``jobs/gpu_exactness.py``. Imports torch, transformers, pyarrow, ``orthrus`` and ``jobs.bench.speed`` only: nothing from ``pipeline``
(pydantic, Ray), which a bare GPU image lacks. Steps run in order; one is skipped, with the reason,
when the budget has less time left than its estimate or it cannot run here (CUDA only, no
flash-attn); one that raises is recorded with its error and the next runs; a timer interrupts one
that outruns the budget. ``<out>/gpu-check.json`` is rewritten (temp + rename) after EVERY step, so
a run stopped early still returns what it measured; bench steps also write ``bench-<device>.json``.

| step                       | what                                                          | H200 s, est. |
|----------------------------|---------------------------------------------------------------|--------------|
| sdpa_backends              | SDPA flags, priority; the backend the engine's shapes get     |  5           |
| fp32_graphs_vs_eager       | fp32 bundled model: CUDA graphs vs eager, token for token     | 30           |
| paged_preemption           | fp32, graphs: a KV pool of ~1 row (preemption) vs a roomy one | 20           |
| bf16_speculative_vs_ar     | what the job's lossless audit reports on a bf16 run           | 15           |
| bf16_flash_graphs_vs_eager | flash + graphs vs eager SDPA (with flash-attn only)           | 20           |
| sync_debug                 | one decode iteration under ``set_sync_debug_mode("warn")``    | 10           |
| bench_model                | bf16 Qwen3-1.7B-shaped random weights + the HF twin           | 40           |
| bench_forward_profile      | ms per forward, B in {1, 8, 32, 128} x T in {1 ... 32}        | 20           |
| bench_b1                   | orthrus, ar; rows = B, 64 new tokens, 2 reps + a warm-up      | 30           |
| bench_b8 / b32 / b128      | orthrus, auto, ar, hf (transformers ``generate``)             | 40 / 45 / 70 |
| bench_eager_b1 / b8        | eager SDPA (no CUDA graphs), orthrus and ar: the baseline     | 30 / 30      |
| bench_verify               | a K = 8 cycle at B = 64, 128: every draft vs 3/8, 2/8 (pinned) | 60           |
| bench_plot                 | ``bench-cuda.png``                                            |  5           |

Measured on the H200 (2026-12-04, ``gpu-check/``): the whole run took 239 s without flash-attn (the
image has none). An eager forward of the 1.7B shape is launch-bound, 25-45 ms at any B and T (about
4,500 aten ops a K = 32 cycle, 2,300 an AR step, at ~6 us each); with CUDA graphs (the default on
CUDA since then) an AR step at B = 8 is ~5x faster. Random weights accept ~no drafts (a 64-token
row = 64 cycles). The estimates above are those first timings with a margin for first-use costs.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import torch
import transformers

from jobs.bench import common
from jobs.bench import speed as bench
from jobs.bench import verify as verify_bench
from jobs.gpu_budget import STAMP, Budget, Step, commit, guard, write_json
from jobs.gpu_exactness import (bf16_flash_graphs_vs_eager, bf16_speculative_vs_ar, fp32_graphs_vs_eager,
                                load_prompts, paged_preemption)
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.testing.host_syncs import count_host_reads
from orthrus.model import flash

# Per device: exactness prompts and new tokens; bench batch sizes, new tokens, timed repetitions.
SIZES = {"cuda": {"n": 24, "max_new": 64, "batch_sizes": (1, 8, 32, 128), "bench_new": 64, "reps": 2},
         "cpu": {"n": 10, "max_new": 12, "batch_sizes": (1, 2), "bench_new": 8, "reps": 1}}
ESTIMATE_S = {"sdpa_backends": 5, "fp32_graphs_vs_eager": 30, "paged_preemption": 20, "bf16_speculative_vs_ar": 15,
              "bf16_flash_graphs_vs_eager": 20, "sync_debug": 10, "bench_model": 40, "bench_forward_profile": 20,
              "bench_b1": 30, "bench_b8": 40, "bench_b32": 45, "bench_b128": 70,
              "bench_eager_b1": 30, "bench_eager_b8": 30, "bench_verify": 60, "bench_plot": 5}
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

    def bench_args(self, eager: bool = False) -> argparse.Namespace:
        """The trimmed bench: rows = B (one wave), few repetitions; eager SDPA (no graphs) if asked."""
        args = common.parse_args(["speed", "--device", self.device.type, "--model", self.args.model, "--prompts",
                                  self.args.prompts, "--max-new-tokens", str(self.sizes["bench_new"]), "--reps",
                                  str(self.sizes["reps"]), "--min-rows", "1", "--no-job",
                                  "--attention", "sdpa" if eager else "auto"])
        args.cuda_graphs = False if eager else None
        return args

    def bench_model(self) -> dict:
        args = self.bench_args()
        torch.manual_seed(0)
        model, prompts = bench.gpu_model() if self.device.type == "cuda" else bench.cpu_model(args)
        self.bench.update(model=model, prompts=prompts, hf=bench.hf_twin(model, args.device))
        head = {"device": args.device, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                "block_size": model.block_size, "reps": args.reps, "rows": "B"}
        self.bench["report"] = {**head, "results": {}}
        self.bench["eager_report"] = {**head, "attention": "sdpa", "cuda_graphs": False, "results": {}}
        return {"parameters": sum(p.numel() for p in model.parameters()), "prompts": len(prompts), **_cuda_mib()}

    def bench_forward_profile(self) -> dict:
        ms = bench.forward_profile(self.bench["model"], list(self.sizes["batch_sizes"]))
        self.bench["report"]["forward_ms"] = ms
        self._save_bench()
        return ms

    def bench_batch(self, b: int, eager: bool = False) -> dict:
        # At B = 1, HF generate and the auto policy's probing are the slowest cells and tell the least.
        modes = ["orthrus", "ar"] if b == 1 or eager else list(bench.MODES)
        st = self.bench
        with warnings.catch_warnings(record=True) as caught:     # a failed capture warns (graphs.py)
            warnings.simplefilter("always")
            cells = bench.bench_batch(b, self.bench_args(eager), st["model"], st["prompts"], st["hf"], modes)
        cells["warnings"] = sorted({str(w.message)[:300] for w in caught})[:10]
        bench.print_row(b, cells)
        st["eager_report" if eager else "report"]["results"][str(b)] = cells
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

    def bench_plot(self) -> dict:
        path = self.out / f"bench-{self.device.type}.png"
        bench.plot(self.bench["report"], str(path))
        return {"plot": path.name}

    def _save_bench(self) -> None:
        dev = self.device.type
        for key, name in (("report", f"bench-{dev}.json"), ("eager_report", f"bench-{dev}-eager.json")):
            if self.bench[key].get("results") or self.bench[key].get("forward_ms"):
                write_json(self.out / name, {**self.bench[key], **_cuda_mib()})


def _cuda_mib() -> dict:
    return {"peak_cuda_mib": torch.cuda.max_memory_allocated() / 2 ** 20} if torch.cuda.is_available() else {}


def _environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    gib = guard(lambda: torch.cuda.get_device_properties(device).total_memory / 2 ** 30) if cuda else None
    return {"device": guard(lambda: torch.cuda.get_device_name(device)) if cuda else "cpu", "memory_gib": gib,
            "torch": torch.__version__, "transformers": transformers.__version__, "cuda_runtime": torch.version.cuda,
            "python": sys.version.split()[0], "sizes": SIZES[device.type],
            "flash_attn": flash.unavailable_reason(device, torch.bfloat16) or "importable", "commit": commit()}


def dry_run(args: argparse.Namespace, stamp_path: Path = STAMP) -> None:
    """Print the plan (each step, its estimate, their sum against the budget) and stamp the commit
    at ``stamp_path`` (the tree's ``GPU_CHECK_COMMIT``: the device machine's copy has no ``.git``)."""
    check = Check.__new__(Check)          # the steps' names only: no output directory, no report
    check.args, check.device, check.sizes, check.bench = args, torch.device(args.device), SIZES[args.device], {}
    names = [s.name for s in selected(steps(check), args.only) if s.why_not is None or s.why_not() != "not in --only"]
    total = sum(ESTIMATE_S.get(n, 0) for n in names)
    for n in names:
        print(f"  {n:<28} {ESTIMATE_S.get(n, 0):>4} s", flush=True)
    stamp = commit()
    if stamp is not None:
        stamp_path.write_text(stamp + "\n")
    print(f"[gpu_check] plan: {len(names)} steps, about {total} s (budget {args.budget_s:.0f} s); commit {stamp}",
          flush=True)


def steps(check: Check) -> list[Step]:
    """Every step, in the order of the module docstring's table."""
    a, dev, sizes = check.args, check.args.device, check.sizes

    def has_model() -> str | None:
        return "--skip-bench" if a.skip_bench else (None if "model" in check.bench else "bench_model did not run")

    def on_cuda() -> str | None:
        return f"needs CUDA (running on {dev})" if dev != "cuda" else has_model()

    def exact(fn):
        return lambda: fn(a.model, check.prompts, dev, sizes["max_new"])
    out = [Step("sdpa_backends", lambda: sdpa_backends(check.device)),
           Step("fp32_graphs_vs_eager", exact(fp32_graphs_vs_eager)),
           Step("paged_preemption", exact(paged_preemption)),
           Step("bf16_speculative_vs_ar", exact(bf16_speculative_vs_ar)),
           Step("bf16_flash_graphs_vs_eager", exact(bf16_flash_graphs_vs_eager),
                lambda: flash.unavailable_reason(check.device, torch.bfloat16)),
           Step("sync_debug", lambda: sync_debug(a.model, check.prompts, dev)),
           Step("bench_model", check.bench_model, lambda: "--skip-bench" if a.skip_bench else None),
           Step("bench_forward_profile", check.bench_forward_profile, has_model)]
    out += [Step(f"bench_b{b}", lambda b=b: check.bench_batch(b), has_model) for b in sizes["batch_sizes"]]
    out += [Step(f"bench_eager_b{b}", lambda b=b: check.bench_batch(b, eager=True), on_cuda) for b in (1, 8)]
    out.append(Step("bench_verify", check.bench_verify, has_model))
    return out + [Step("bench_plot", check.bench_plot,
                       lambda: None if check.bench.get("report", {}).get("results") else "no bench results")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check")
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
