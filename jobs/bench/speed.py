"""Speed: Orthrus vs our AR mode vs transformers ``generate``, per batch size (the default workload).

    python -m jobs.bench                       # CPU, bundled model + held-out prompts
    python -m jobs.bench --device cuda         # H200: bf16, Qwen3-1.7B-shaped random weights, K=32

All modes run in one process, interleaved, on the same prompts and seeds; each cell is the median
of ``--reps`` repetitions. Ratios (not absolute seconds) are what to compare on a shared machine.
Time split: draft forward / verify forward / the rest (sampling, acceptance, host bookkeeping),
measured by timing the model's forward calls (synchronising first on GPU). On CPU with ``--job``
the report also holds the job around the engine (``job.py``: Ray job vs bare engine, audit,
storage, scale). Writes ``bench-results/speed.json`` and ``speed.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

# Only modules that need no more than torch, transformers and pyarrow here: jobs.gpu_check imports
# this file on a bare GPU image (no pydantic, no Ray). The job's sections (job.py → pipeline) are
# imported where they run.
from jobs.bench import common
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams, tokens_per_cycle
from orthrus.model.backends import BlockBatch
from orthrus.ranges import RangeTimer

MODES = ("orthrus", "auto", "ar", "hf")


def add_args(ap) -> None:
    """The speed workload's own arguments."""
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-seq-len", type=int, default=1024,
                    help="the engine's context limit (its cache capacity per slot), capped at the model's")
    ap.add_argument("--block-size", type=int, default=None, help="draft block size K (default: the model's)")
    ap.add_argument("--skewed-rows", type=int, default=256,
                    help="rows of the length-skewed job workload (streaming vs batch-at-a-time vs bare engine)")
    ap.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash"],
                    help="KV-cache attention kernel (auto = flash when importable on CUDA)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="replay each steady-state iteration as a captured CUDA graph (default: with flash)")
    ap.add_argument("--scale-sizes", default="0.2M,2M,20M",
                    help="input rows of the job-at-scale section (scale.py; CPU, with --job); '' skips it")


class ForwardTimer(RangeTimer):
    """Seconds in the model's draft and verify forwards (the prefill's included), from the engine's
    named ranges. Only for eager engines: timing needs a device sync around every forward, which a
    captured CUDA graph cannot contain (static-shape engines report no split)."""

    def __init__(self, model: OrthrusForCausalLM, enabled: bool) -> None:
        super().__init__(torch.cuda.synchronize if next(model.parameters()).is_cuda else None)
        self.enabled = enabled

    def split(self, total: float) -> dict:
        """The last run's draft / verify / rest seconds (None without a split)."""
        if not self.enabled:
            return {"draft_s": None, "verify_s": None, "rest_s": None}
        d, v = self.seconds["draft_forward"], self.seconds["verify_forward"]
        return {"draft_s": d, "verify_s": v, "rest_s": total - d - v}


def gpu_model() -> tuple[OrthrusForCausalLM, list[list[int]]]:
    """Qwen3-1.7B-shaped random weights in bf16 and random prompts (cost ratios only)."""
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=6144, max_position_embeddings=40960,
                      tie_word_embeddings=True, eos_token_id=[151645, 151643])
    cfg.block_size, cfg.mask_token_id = 32, 151669
    with torch.device("cuda"):
        model = OrthrusForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    return model, [torch.randint(0, 150000, (200,), generator=g).tolist() for _ in range(256)]


def cpu_model(args) -> tuple[OrthrusForCausalLM, list[list[int]]]:
    """The bundled model and its held-out prompts."""
    return common.load_model(args.model), common.load_prompts(args.model, args.prompts)[1]


def run_engine(engine: OrthrusEngine, timer: ForwardTimer, prompts, max_new: int, mode: str) -> dict:
    """One timed ``generate`` of ``mode`` → tokens/s, tokens per cycle and the time split."""
    timer.seconds.clear()
    spec = {"orthrus": True, "auto": "auto", "ar": False}[mode]
    params = [SamplingParams(max_new_tokens=max_new, seed=i) for i in range(len(prompts))]
    with timer if timer.enabled else contextlib.nullcontext():
        dt, res = common.time_generate(engine, prompts, params, spec)
    tokens = sum(len(r.token_ids) for r in res)
    cycles = sum(r.stats.num_cycles for r in res)
    iters = cycles + sum(r.stats.num_ar_steps for r in res)
    tpc = tokens_per_cycle(sum(r.stats.num_accepted_draft_tokens for r in res), iters)
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt, "tokens_per_cycle": tpc,
            "tpf": tpc / 2 if mode == "orthrus" else None, **timer.split(dt)}


def run_hf(hf: Qwen3ForCausalLM, prompts, b: int, max_new: int, eos: tuple[int, ...], device: str) -> dict:
    """HF ``generate`` on consecutive padded batches of ``b`` prompts."""
    t = time.perf_counter()
    tokens = sum(_hf_batch(hf, prompts[i: i + b], max_new, eos, device) for i in range(0, len(prompts), b))
    dt = time.perf_counter() - t
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt}


def _hf_batch(hf: Qwen3ForCausalLM, prompts, max_new: int, eos: tuple[int, ...], device: str) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):            # left padding, as HF batched generation expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=list(eos), pad_token_id=0)
    gen = out[:, width:].tolist()  # SYNC: once per HF batch, outside our engine
    return sum(next((i + 1 for i, x in enumerate(row) if x in eos), len(row)) for row in gen)


def bench_batch(b: int, args, model, prompts, hf, modes) -> dict:
    """Interleaved repetitions of every mode at one batch size (the first rep is a warm-up)."""
    engine = OrthrusEngine(model, max_batch_size=b, block_size=args.block_size,
                           max_seq_len=min(args.max_seq_len, model.config.max_position_embeddings),
                           attention=args.attention,
                           static_shapes=args.cuda_graphs if args.device == "cuda" else False)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer = ForwardTimer(model, enabled=not engine.static_shapes)
    batch_prompts = [prompts[i % len(prompts)] for i in range(max(b, args.min_rows))]
    runs = {m: (lambda: run_hf(hf, batch_prompts, b, args.max_new_tokens, engine.eos_token_ids, args.device))
            if m == "hf" else (lambda m=m: run_engine(engine, timer, batch_prompts, args.max_new_tokens, m))
            for m in modes}
    samples = common.rounds(runs, args.reps, rotate=False).samples     # modes in order; round 0 a warm-up
    cells = {mode: common.median_cell(s) for mode, s in samples.items() if s}
    for mode, cell in cells.items():
        if "ar" in cells:
            cell["vs_ar"] = cell["tokens_per_s"] / cells["ar"]["tokens_per_s"]
        if "hf" in cells:
            cell["vs_hf"] = cell["tokens_per_s"] / cells["hf"]["tokens_per_s"]
    if "orthrus" in cells and "ar" in cells:
        cycle = cells["orthrus"]["seconds"] / max(1, cells["orthrus"]["tokens"] / cells["orthrus"]["tokens_per_cycle"])
        step = cells["ar"]["seconds"] / max(1, cells["ar"]["tokens"])
        cells["cycle_over_ar_step"] = cycle / step
    cells["host_reads_per_iteration"] = common.host_reads_per_iteration(    # one untimed Orthrus run
        engine, lambda: engine.generate(batch_prompts, SamplingParams(max_new_tokens=args.max_new_tokens),
                                        speculative=True))
    cells["engine"] = {"attention": engine.attention, "cuda_graphs": engine.static_shapes and args.device == "cuda",
                       "kv_cache_mib": sum(t.numel() * t.element_size() for t in engine.cache.k + engine.cache.v) / 2 ** 20}
    if args.device == "cuda":
        cells["engine"]["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return cells


def forward_profile(model: OrthrusForCausalLM, sizes: list[int], prefix: int = 200,
                    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32), reps: int = 7) -> dict[str, dict[str, float]]:
    """Median ms of one AR-view forward + LM head over T new tokens per row at B rows, after a
    ``prefix``-token context: the cost model under every ratio above (a cycle is two forwards over
    K tokens plus sampling, an AR step one forward over 1 token)."""
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    profile: dict[str, dict[str, float]] = {}
    for b in sizes:
        engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=prefix + max(tokens) + 1)
        engine.cache.lengths.fill_(prefix)
        engine.cache.assign_contiguous()          # every slot its own pages (the default pool holds them)
        row: dict[str, float] = {}
        for t in tokens:
            pos = prefix + torch.arange(t, device=dev)[None].expand(b, t)
            batch, ids = BlockBatch(None, pos, prefix + t), torch.zeros((b, t), dtype=torch.long, device=dev)
            times = []
            with torch.inference_mode():
                for _ in range(reps + 1):
                    sync()
                    start = time.perf_counter()
                    model.logits(model.forward_cached(ids, engine.cache, batch, diffusion=False,
                                                      backend=engine.backend))
                    sync()
                    times.append(time.perf_counter() - start)
            row[str(t)] = 1000 * statistics.median(times[1:])
        profile[str(b)] = row
        print(f"forward ms at B={b}: " + "  ".join(f"T={t}: {ms:.2f}" for t, ms in row.items()), flush=True)
    return profile


def main(args: argparse.Namespace) -> None:
    """Every batch size (and on CPU with ``--job`` the job's sections) → the report and its plot."""
    common.set_threads(args)
    torch.manual_seed(0)
    model, prompts = gpu_model() if args.device == "cuda" else cpu_model(args)
    sizes = common.batch_sizes(args, "1,8,32,128" if args.device == "cuda" else "1,4,16,64")
    modes = [m for m in args.modes.split(",") if m]
    hf = hf_twin(model, args.device) if "hf" in modes else None
    report = {"device": args.device, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "block_size": args.block_size or model.block_size, "reps": args.reps, "results": {}}
    report["forward_ms"] = forward_profile(model, sizes)
    for b in sizes:
        report["results"][b] = bench_batch(b, args, model, prompts, hf, modes)
        print_row(b, report["results"][b])
    if args.job and args.device == "cpu":
        from jobs.bench.job import job_sections          # pipeline, pydantic, Ray
        job_sections(report, args, model, prompts)
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device == "cuda":
        report["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    common.write_report(args, report)
    plot(report, str(common.results_path(args, ".png")))


def hf_twin(model: OrthrusForCausalLM, device: str) -> Qwen3ForCausalLM:
    """transformers' Qwen3 with the AR view's weights (the ``hf`` mode's model)."""
    with torch.device(device):    # built in place: a 1.7B model initialised on the host is slow
        hf = Qwen3ForCausalLM(model.config).to(next(model.parameters()).dtype).eval()
    hf.load_state_dict({k: v for k, v in model.state_dict().items() if "_diff." not in k}, strict=False)
    return hf


def plot(report: dict, path: str) -> None:
    """Tokens/s per batch size for each mode (docs/performance.md's figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted(report["results"], key=int)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in MODES:
        ys = [report["results"][b].get(mode, {}).get("tokens_per_s") for b in sizes]
        if any(y is not None for y in ys):
            ax.plot([int(b) for b in sizes], ys, marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report['device']}, K={report['block_size']}, {report['max_new_tokens']} new tokens (medians)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_row(b: int, cells: dict) -> None:
    """One batch size's cells as one printed line."""
    parts = [f"B={b:<4}"]
    for mode in MODES:
        c = cells.get(mode)
        if c:
            extra = f" tpc={c['tokens_per_cycle']:.2f}" if "tokens_per_cycle" in c else ""
            ratio = f" ×AR={c['vs_ar']:.2f}" if "vs_ar" in c and mode != "ar" else ""
            ratio += f" ×HF={c['vs_hf']:.2f}" if "vs_hf" in c and mode != "hf" else ""
            parts.append(f"{mode}: {c['tokens_per_s']:.0f} tok/s{extra}{ratio}")
    if "cycle_over_ar_step" in cells:
        parts.append(f"cycle/AR-step={cells['cycle_over_ar_step']:.2f}")
    parts.append(f"host reads/iteration={cells['host_reads_per_iteration']:g}")
    print(" | ".join(parts), flush=True)

