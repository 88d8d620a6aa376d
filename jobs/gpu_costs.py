"""The GPU check's cost steps (``jobs/gpu_check.py``): what one decode iteration costs at steady state,
per batch size, block size and way of running it, and where an AR step's time goes.

- ``step_costs``: ms per AR step and per speculative cycle (block K, every draft verified) for B rows
  that never finish (``ignore_eos``), timed over steps with no prefill in them; AR tokens/s = B ÷ the
  AR step, and R = cycle ÷ AR step, the number that decides whether speculation pays at a given
  acceptance (docs/design.md §2). ``mode``: ``eager`` (no graphs), ``graphs`` (CUDA graphs, the
  default on CUDA), ``compiled`` (inductor kernels under the graphs).
- ``profile_ar_step``: a profiler trace of AR steps: kernels per step, the top kernels by device
  time, and the host gap (wall time the device spent idle, waiting for launches).
- ``sampling_cost``: an AR step sampling (temperature, top-p) ÷ a greedy one at the model's
  vocabulary (151,936 at the 1.7B shape).

Random weights accept no drafts, so a cycle here yields one token: only the costs mean anything.
Imports torch and ``orthrus`` only (the device image has no pydantic or Ray).
"""
from __future__ import annotations

import gzip
import json
import statistics
import time
from pathlib import Path

import torch

from jobs.bench.common import sync_of
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams

MODES = {"eager": {"static_shapes": False}, "graphs": {"static_shapes": True},
         "compiled": {"static_shapes": True, "compile": True}}
PROMPT_TOKENS = 48        # each row's prompt: short, so the context stays near this at every B


def steady_engine(model: OrthrusForCausalLM, prompts: list[list[int]], b: int, block: int | None, mode: str,
                  params: SamplingParams | None = None, max_seq_len: int = 512) -> OrthrusEngine:
    """An engine with ``b`` rows decoding (prefills done, graphs captured): speculative cycles of
    ``block`` (every draft verified), or AR steps (``block`` None)."""
    spec = block is not None
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=max_seq_len, speculative=spec,
                           adaptive_verify=False, **({"block_size": block} if spec else {}), **MODES[mode])
    params = params or SamplingParams(temperature=0.0, max_new_tokens=max_seq_len, ignore_eos=True)
    for i in range(b):
        engine.add_request(prompts[i % len(prompts)][:PROMPT_TOKENS], params)
    before = None
    while before is None or engine.stats.prefill_tokens != before:   # bounded: b prompts of PROMPT_TOKENS
        before = engine.stats.prefill_tokens
        engine.step()
    engine.step()                          # the first decode iteration of this shape (captures it)
    return engine


def time_steps(engine: OrthrusEngine, steps: int) -> float:
    """Median seconds of ``steps`` steady steps, each timed with device syncs around it (asserting
    that no prefill ran in them: a row that finished early would make it a different workload)."""
    before, times, sync = engine.stats, [], sync_of(engine)
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    delta = engine.stats - before
    assert delta.prefill_tokens == 0 and delta.iterations == steps, "a timed step was not a steady decode step"
    return statistics.median(times)


def step_costs(model: OrthrusForCausalLM, prompts: list[list[int]], batch_sizes: tuple[int, ...],
               blocks: tuple[int, ...], mode: str, steps: int) -> dict:
    """Per B: AR ms per step and tokens/s, and per K the cycle's ms and R = cycle ÷ AR step."""
    out: dict = {}
    for b in batch_sizes:
        t0 = time.perf_counter()
        ar = time_steps(steady_engine(model, prompts, b, None, mode), steps)
        cell = {"ar_ms": round(ar * 1e3, 3), "ar_tokens_per_s": round(b / ar, 1)}
        for k in blocks:
            cycle = time_steps(steady_engine(model, prompts, b, k, mode), steps)
            cell[f"K={k}"] = {"cycle_ms": round(cycle * 1e3, 3), "R": round(cycle / ar, 3)}
        cell["seconds"] = round(time.perf_counter() - t0, 1)
        out[f"B={b}"] = cell
        print(f"[gpu_check] {mode} B={b}: {json.dumps(cell)}", flush=True)
    return out


def weight_read_floor_ms(model: OrthrusForCausalLM, device: torch.device) -> float | None:
    """ms to read the AR view's weights once at the device's peak bandwidth (H100 SXM 3.35 TB/s,
    H200 4.8 TB/s): the floor an AR step at small B cannot beat. None off those devices."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    bandwidth = 4.8e12 if "H200" in name else 3.35e12 if "H100" in name else None
    ar_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "_diff." not in n)
    return None if bandwidth is None else round(ar_bytes / bandwidth * 1e3, 3)


def profile_ar_step(model: OrthrusForCausalLM, prompts: list[list[int]], b: int, steps: int, out: Path) -> dict:
    """AR steps at ``b`` rows under the profiler, eager and with graphs: kernels (on CPU: ops) per
    step, the top 10 by device time, device-busy vs wall time; the eager trace is written gzipped."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    report: dict = {"weight_read_floor_ms": weight_read_floor_ms(model, device)}
    for mode in ("eager", "graphs"):
        engine = steady_engine(model, prompts, b, None, mode)
        sync = sync_of(engine)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            wall = time.perf_counter() - t0
        events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda]
        kernels = [e for e in events if cuda or e.name.startswith("aten::")]
        busy_us = sum(e.device_time_total if cuda else e.self_cpu_time_total for e in prof.key_averages()
                      if (cuda and e.device_time_total) or (not cuda and e.key.startswith("aten::")))
        top = sorted(prof.key_averages(), key=lambda e: e.device_time_total if cuda else e.self_cpu_time_total,
                     reverse=True)[:10]
        report[mode] = {
            "step_ms": round(wall / steps * 1e3, 3), "kernels_per_step": len(kernels) / steps,
            "unit": "CUDA kernels" if cuda else "aten ops (CPU: nested ops included)",
            "device_busy_ms_per_step": round(busy_us / steps / 1e3, 3),
            "host_gap_ms_per_step": round(max(0.0, wall * 1e6 - busy_us) / steps / 1e3, 3) if cuda else None,
            "top": [{"name": e.key[:120], "calls_per_step": e.count / steps,
                     "ms_per_step": round((e.device_time_total if cuda else e.self_cpu_time_total) / steps / 1e3, 4)}
                    for e in top]}
        if mode == "eager":
            trace = out / f"trace-ar-b{b}-eager.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                dst.write(src.read())
            trace.unlink()
            report[mode]["trace"] = trace.name + ".gz"
    return report


def sampling_cost(model: OrthrusForCausalLM, prompts: list[list[int]], batch_sizes: tuple[int, ...], steps: int) -> dict:
    """Per B: an AR step sampling with temperature 0.8 and top-p 0.95 ÷ a greedy one (graphs)."""
    out: dict = {"vocab": int(model.config.vocab_size)}
    for b in batch_sizes:
        greedy = time_steps(steady_engine(model, prompts, b, None, "graphs"), steps)
        sampled_params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=512, ignore_eos=True, seed=0)
        sampled = time_steps(steady_engine(model, prompts, b, None, "graphs", sampled_params), steps)
        out[f"B={b}"] = {"greedy_ms": round(greedy * 1e3, 3), "sampled_ms": round(sampled * 1e3, 3),
                         "sampled_over_greedy": round(sampled / greedy, 3)}
    return out
