"""The GPU check's exactness steps (``jobs/gpu_check.py``): the engine's tokens on real kernels
against its own reference paths — CUDA graphs vs eager and compiled vs eager (float32), a tight KV
pool with preemption vs a roomy one, speculative vs AR and flash + graphs vs eager SDPA (bf16). Imports torch,
transformers and ``orthrus`` only (the device image has no pydantic or Ray).
"""
from __future__ import annotations

import torch
from transformers import AutoTokenizer

from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.model import flash


def load_prompts(model_dir: str, shards: str, n: int) -> list[list[int]]:
    """``n`` held-out prompts as token ids (the bundled model's tokenizer)."""
    return load_prompt_ids(AutoTokenizer.from_pretrained(model_dir), shards, n=n)


def _tokens(model, prompts, params, **engine_kwargs) -> tuple[list[list[int]], dict]:
    """Token ids per prompt, and what the engine's CUDA graphs did (captured, failed to capture)."""
    engine = OrthrusEngine(model, max_batch_size=8, max_seq_len=512, **engine_kwargs)
    warm = params if isinstance(params, SamplingParams) else params[:8]
    engine.generate(prompts[:8], warm)                      # warm-up: captures the graphs
    tokens = [r.token_ids for r in engine.generate(prompts, params)]
    graphs = engine.runner.graphs
    return tokens, {"captured": len(graphs.graphs), "eager_only": len(graphs.eager_only),
                    "capture_failures": list(getattr(graphs, "capture_failures", ["(not recorded)"]))}


def _agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """Share of identical rows, and where the first differing row departs. On a GPU, float32 is
    not bit-stable across batch shapes (cuBLAS picks kernels by shape), so a rare late
    divergence is expected; an early one in most rows is a bug."""
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(got, want) if a != b]
    return {"rows_equal": sum(a == b for a, b in zip(got, want)) / len(want),
            "first_divergence_at_token": min(diverge) if diverge else None}


def fp32_graphs_vs_eager(model_dir: str, prompts, device: str, max_new: int) -> dict:
    """Static shapes replayed from CUDA graphs vs eager SDPA, float32, greedy and seeded sampling
    (on a CPU the static path runs without capture)."""
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    report, graphs = {}, {}
    for name, params in (("greedy", SamplingParams(temperature=0.0, max_new_tokens=max_new)),
                         ("sampled", [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=max_new, seed=i)
                                      for i in range(len(prompts))])):
        eager, _ = _tokens(model, prompts, params, attention="sdpa", static_shapes=False)
        got, graphs[name] = _tokens(model, prompts, params, attention="sdpa", static_shapes=True)  # forced
        report[f"fp32_{name}_graphs_vs_eager"] = _agreement(got, eager)
    return {**report, "cuda_graphs": graphs}


def fp32_compiled_vs_eager(model_dir: str, prompts, device: str, max_new: int) -> dict:
    """Compiled kernels (``compile=True``, under CUDA graphs on CUDA) vs eager SDPA, float32: greedy
    speculative and AR, and seeded sampling; plus speculative == AR with compile on."""
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    report, graphs = {}, {}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=max_new, seed=i) for i in range(len(prompts))]
    compiled = {}
    for name, params, spec in (("greedy", greedy, True), ("greedy_ar", greedy, False), ("sampled", sampled, True)):
        eager, _ = _tokens(model, prompts, params, attention="sdpa", static_shapes=False, speculative=spec)
        compiled[name], graphs[name] = _tokens(model, prompts, params, attention="sdpa", static_shapes=True,
                                               compile=True, speculative=spec)
        report[f"fp32_{name}_compiled_vs_eager"] = _agreement(compiled[name], eager)
    report["fp32_greedy_compiled_speculative_vs_ar"] = _agreement(compiled["greedy"], compiled["greedy_ar"])
    return {**report, "cuda_graphs": graphs}


def paged_preemption(model_dir: str, prompts, device: str, max_new: int) -> dict:
    """The paged KV cache under pressure, float32 with graphs: a pool of one row at full length plus
    a page, so rows are preempted and their K/V recomputed, vs the default pool (every slot at full
    length), greedy and seeded sampling; rows equal, and how many preemptions it took."""
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    max_seq_len = max(map(len, prompts)) + max_new + 1
    report = {}
    for name, params in (("greedy", SamplingParams(temperature=0.0, max_new_tokens=max_new, min_tokens=max_new)),
                         ("sampled", [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=max_new,
                                                     min_tokens=max_new, seed=i) for i in range(len(prompts))])):
        outs = {}
        for pool in ("roomy", "tight"):
            engine = OrthrusEngine(model, max_batch_size=8, max_seq_len=max_seq_len, attention="sdpa",
                                   static_shapes=True, kv_cache_tokens=None if pool == "roomy" else
                                   -(-(max_seq_len + model.block_size) // 16) * 16 + 16)
            outs[pool] = ([r.token_ids for r in engine.generate(prompts, params)], engine.stats, engine.kv_pages)
        report[f"fp32_{name}_tight_vs_roomy"] = _agreement(outs["tight"][0], outs["roomy"][0])
        report[f"{name}_preemptions"] = outs["tight"][1].preemptions
        report[f"{name}_recomputed_tokens"] = outs["tight"][1].recomputed_tokens
        report[f"{name}_tight_pages"] = {"total": outs["tight"][2].total, "peak": outs["tight"][2].peak}
    return report


def _bf16_greedy(model_dir: str, prompts, device: str, max_new: int, got: dict, want: dict) -> tuple[dict, dict]:
    """Greedy bf16 tokens of engines built with ``got`` vs ``want``: their agreement, got's graphs."""
    half = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device=device)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    tokens, graphs = _tokens(half, prompts, params, **got)
    return _agreement(tokens, _tokens(half, prompts, params, **want)[0]), graphs


def bf16_speculative_vs_ar(model_dir: str, prompts, device: str, max_new: int) -> dict:
    """What the job's lossless audit (audit.fraction) reports on a bf16 run: speculative vs plain AR."""
    agree, _ = _bf16_greedy(model_dir, prompts, device, max_new, {"attention": "sdpa", "speculative": True},
                            {"attention": "sdpa", "speculative": False})
    return {"bf16_greedy_speculative_vs_ar": agree}


def bf16_flash_graphs_vs_eager(model_dir: str, prompts, device: str, max_new: int) -> dict:
    """Flash + graphs vs eager SDPA in bf16: the share of identical rows (bf16 reductions of
    different shapes may flip near-ties; docs/design.md §2.3, §4.4)."""
    why_not = flash.unavailable_reason(torch.device(device), torch.bfloat16)
    if why_not:
        return {"flash": f"not run: {why_not}"}
    agree, graphs = _bf16_greedy(model_dir, prompts, device, max_new, {"attention": "flash", "static_shapes": True},
                                 {"attention": "sdpa", "static_shapes": False})
    return {"bf16_greedy_flash_graphs_vs_eager": agree, "flash_cuda_graphs": graphs}
