"""The compiled step (``engine.compile``) vs eager: speed, ops per AR step and per cycle, compile time.

    python -m jobs.bench compiled                    # B = 1,8,64; writes bench-results/compiled.json
    python -m jobs.bench compiled --batch-sizes 8 --reps 3 --no-cold-warm

Speed: per batch size B and mode (speculative, AR), the default CPU engine eager and with
``compile=True``, greedy, interleaved pairs (order alternating, the first pair a warm-up that also
compiles); compiled ÷ eager as the median of the pair ratios, and whether the tokens are identical
(they must be). Ops: the aten ops one static AR step and one cycle at B = 8 dispatch eagerly
(a ``TorchDispatchMode`` counter); compiled, the ops still dispatched around the compiled pieces
(attention, sampling, acceptance, commit) plus the kernels the pieces' generated code calls per
layer (inductor's fused kernels and its calls of aten's matmuls). Compile time: the demo job's
graphs (its batch size, mode and prompts) compiled in a fresh process with an empty inductor cache
(cold), then in another with that cache (warm), wall and CPU seconds.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from jobs.bench import common
from jobs.bench.common import REPO

MODES = {"speculative": True, "ar": False}


def make_engine(model, b: int, compile: bool):
    from orthrus import OrthrusEngine
    return OrthrusEngine(model, max_batch_size=b, max_seq_len=min(1024, model.config.max_position_embeddings),
                         compile=compile)


def speed_cell(model, prompts: list[list[int]], b: int, speculative: bool, max_new: int, reps: int) -> dict:
    """Eager vs compiled on one workload, interleaved → the cell."""
    from orthrus import SamplingParams
    engines = {"eager": make_engine(model, b, False), "compiled": make_engine(model, b, True)}
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)

    def run(name: str) -> dict:
        seconds, outs = common.time_generate(engines[name], prompts, params, speculative)
        return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "ids": [o.token_ids for o in outs]}
    r = common.rounds({name: (lambda name=name: run(name)) for name in engines}, reps)
    s = r.samples
    return {"eager_tok_s": common.med(s["eager"], "tok_s"), "compiled_tok_s": common.med(s["compiled"], "tok_s"),
            "compiled_over_eager": common.pair_ratio(s["compiled"], s["eager"], "tok_s"),
            "compiled_runs_tok_s": [c["tok_s"] for c in s["compiled"]],
            "eager_runs_tok_s": [c["tok_s"] for c in s["eager"]],
            "compile_seconds_in_warmup": engines["compiled"].stats.compile_ms / 1000,
            "tokens_identical": all(x == r.ids["eager"][0] for x in r.ids["eager"] + r.ids["compiled"])}


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched while active (a suspended stretch counts nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _iteration(engine, block: int, b: int):
    """One static iteration's plan over slots ``0 … b-1`` (greedy) and a function running it."""
    from orthrus.engine.step import Iteration, SamplingPaths
    plan = engine.runner.plan(Iteration(block, np.arange(b), 0, SamplingPaths(False, True)), None, np.arange(0)).plan
    return plan, (lambda: engine.runner.device_iteration(plan, torch.arange(b)))


def eager_ops(model, block: int, b: int) -> dict:
    """Aten ops of one eager static iteration (``block`` 0: an AR step) at ``b`` rows, and of those
    the ones outside the layer pieces a compiled engine runs compiled (their calls counted apart)."""
    from orthrus.model import compiled
    from orthrus.model.compiled import LayerFns
    engine = _warm_engine(model, b)
    _, run = _iteration(engine, block, b)
    counter, calls = OpCounter(), collections.Counter()

    def uncounted(name, fn):
        def piece(*args):
            calls[name] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return fn(*args)
        return piece
    pieces = LayerFns(before=tuple(uncounted("before", f) for f in (compiled._before_ar, compiled._before_diffusion)),
                      after=tuple(uncounted("after", f) for f in (compiled._after_ar, compiled._after_diffusion)))
    with torch.inference_mode():
        run()
        with counter:
            run()
        total, top = sum(counter.ops.values()), counter.ops.most_common(8)
        counter.ops.clear()
        with compiled.using(pieces), counter:
            run()
    return {"eager_ops": total, "ops_outside_pieces": sum(counter.ops.values()), "piece_calls": dict(calls),
            "top_eager_ops": dict(top), "top_ops_outside_pieces": dict(counter.ops.most_common(8))}


def _warm_engine(model, b: int):
    from orthrus import OrthrusEngine, SamplingParams
    engine = OrthrusEngine(model, max_batch_size=b, static_shapes=True, adaptive_verify=False)
    engine.generate([[1, 2, 3]] * b, SamplingParams(max_new_tokens=4))
    return engine


def piece_kernels(model) -> dict:
    """The kernels each compiled piece's generated code calls per layer (AR view, 16 tokens): fused
    kernels inductor generated, and the extern (aten) calls it kept (matmuls), from its source."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from orthrus.model import compiled
    layer, e = model.model.layers[0], model.config.hidden_size
    n, d = 16, model.model.layers[0].self_attn.head_dim
    h, cos, sin = torch.randn(1, n, e), torch.randn(1, n, d), torch.randn(1, n, d)
    heads = layer.self_attn.num_heads
    out = {}
    with torch.inference_mode(), inductor_config.patch(force_disable_caches=True):
        for name, fn, args in (("before", compiled._before_ar, (layer, h, cos, sin)),
                               ("after", compiled._after_ar, (layer, h, torch.randn(1, n, heads * d)))):
            fresh = torch.compile(compiled._own_code(fn), fullgraph=True, dynamic=True)
            _, codes = run_and_get_code(fresh, *args)
            out[name] = _calls(codes[-1])
    return out


def _calls(code: str) -> dict:
    """Kernel calls in the ``call`` function of inductor's generated wrapper."""
    body = code[code.index("def call("):]
    body = body[: body.find("\ndef ", 1)] if "\ndef " in body[1:] else body
    return {"fused": len(re.findall(r"^\s+cpp_fused_\w+\(", body, re.M)),
            "extern": len(re.findall(r"extern_kernels\.\w+\(", body)),
            "aten": len(re.findall(r"torch\.ops\.aten\.\w+", body))}


def ops_report(model, b: int) -> dict:
    """Ops per AR step and per cycle at ``b`` rows, eager and compiled (see the module docstring)."""
    kernels = piece_kernels(model)
    per_call = {name: sum(k.values()) for name, k in kernels.items()}
    report = {"piece_kernels_per_layer": kernels}
    for label, block in (("ar_step", 0), ("cycle", model.block_size)):
        cell = eager_ops(model, block, b)
        cell["compiled_ops"] = cell["ops_outside_pieces"] + sum(per_call[k] * v for k, v in cell["piece_calls"].items())
        report[label] = cell
    return report


_PROBE = """
import json, resource, sys, time, torch
from jobs.bench import common
from orthrus import OrthrusEngine, SamplingParams
model = common.load_model(sys.argv[1])
prompts = common.load_prompts(sys.argv[1], sys.argv[2])[1][:16]
engine = OrthrusEngine(model, max_batch_size=8, compile=True)
t = time.perf_counter()
engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=96))
cpu = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"compile_seconds": engine.stats.compile_ms / 1000, "generate_seconds": time.perf_counter() - t,
                  "process_cpu_seconds": cpu.ru_utime + cpu.ru_stime}))
"""


def cold_warm(model_dir: str, prompts_dir: str) -> dict:
    """The demo job's engine (B = 8, speculative, greedy, 96 new tokens) compiling its graphs in a
    fresh process with an empty cache, then in another with that cache."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="orthrus-inductor-") as cache:
        env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
        for name in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", _PROBE, model_dir, prompts_dir], cwd=REPO, env=env,
                                  capture_output=True, text=True, check=True)
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"compile, {name} cache: {out[name]}", flush=True)
    return out


def add_args(ap) -> None:
    """``--cold-warm`` (default on); batch sizes default to 1,8,64, one thread."""
    ap.add_argument("--cold-warm", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the demo job's compile in fresh processes, cold cache then warm")
    ap.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                    help="also count the ops of an AR step and a cycle at B = 8, eager and compiled")
    ap.set_defaults(batch_sizes="1,8,64", threads=1, reps=3, max_new_tokens=32)


def main(args: argparse.Namespace) -> None:
    """Speed per B and mode, ops per step, compile cold and warm → ``bench-results/compiled.json``."""
    common.set_threads(args)
    model = common.load_model(args.model)
    prompts = common.load_prompts(args.model, args.prompts)[1]
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "reps": args.reps,
                    "max_new_tokens": args.max_new_tokens, "load_average_at_start": _load(), "speed": {}}
    if args.ops:
        report["ops"] = ops_report(model, 8)
        print(f"ops: {json.dumps(report['ops'])}", flush=True)
    if args.cold_warm:
        report["compile"] = cold_warm(args.model, args.prompts)
    for b in common.batch_sizes(args, "1,8,64"):
        rows = [prompts[i % len(prompts)] for i in range(max(b, args.min_rows))]
        for mode, spec in MODES.items():
            started = time.perf_counter()
            cell = speed_cell(model, rows, b, spec, args.max_new_tokens, args.reps)
            cell["load_average"], cell["seconds"] = _load(), time.perf_counter() - started
            report["speed"][f"B={b} {mode}"] = cell
            print(f"B={b:<3} {mode:<11} eager {cell['eager_tok_s']:.0f} tok/s, compiled {cell['compiled_tok_s']:.0f} "
                  f"tok/s: ×{cell['compiled_over_eager']:.3f} (pairs), tokens identical: {cell['tokens_identical']}, "
                  f"load {cell['load_average']}", flush=True)
    common.write_report(args, report)


def _load() -> float:
    return round(__import__("os").getloadavg()[0], 1)
