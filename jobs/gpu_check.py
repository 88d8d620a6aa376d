"""The one script to run when a session is lent a GPU (≤ 10 minutes on an H200).

    python3 -m jobs.gpu_check --out "$OUT"

1. Exactness on the real kernels, which CPU tests can only emulate: the bundled model in float32 on
   CUDA, greedy and seeded sampling, eager SDPA vs static shapes replayed from CUDA graphs — token
   for token. With flash-attn importable, the same in bf16 for flash + graphs vs eager SDPA, reported
   as the share of identical rows (bf16 reductions of different shapes may flip near-ties; DESIGN §3).
   Also bf16 speculative vs plain AR: what the job's lossless audit would report on a bf16 GPU run.
2. ``jobs.bench --device cuda``: bf16 Qwen3-1.7B-shaped random weights, K = 32, B ∈ {1, 8, 32, 128},
   cycle time ÷ AR step time, written to ``<out>/bench-cuda.json`` and its plot (without flash-attn,
   also SDPA + CUDA graphs at B ∈ {1, 8}: ``bench-cuda-sdpa-graphs.json``).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from jobs import bench
from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.model import flash


def _tokens(model, prompts, params, **engine_kwargs) -> list[list[int]]:
    engine = OrthrusEngine(model, max_batch_size=8, max_seq_len=512, **engine_kwargs)
    warm = params if isinstance(params, SamplingParams) else params[:8]
    engine.generate(prompts[:8], warm)                      # warm-up: captures the graphs
    return [r.token_ids for r in engine.generate(prompts, params)]


def _agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """Share of identical rows, and where the first differing row departs. On a GPU, float32 is
    not bit-stable across batch shapes (cuBLAS picks kernels by shape), so a rare late
    divergence is expected; an early one in most rows is a bug."""
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(got, want) if a != b]
    return {"rows_equal": sum(a == b for a, b in zip(got, want)) / len(want),
            "first_divergence_at_token": min(diverge) if diverge else None}


def exactness(model_dir: str, shards: str, device: str = "cuda", n: int = 24, max_new: int = 64) -> dict:
    """Graph/flash paths vs eager SDPA on the bundled model and ``n`` held-out prompts (on a CPU the
    static path runs without capture: a smoke test of this script)."""
    prompts = load_prompt_ids(AutoTokenizer.from_pretrained(model_dir), shards, n=n)
    report = {}
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    for name, params in (("greedy", SamplingParams(temperature=0.0, max_new_tokens=max_new)),
                         ("sampled", [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=max_new, seed=i)
                                      for i in range(len(prompts))])):
        eager = _tokens(model, prompts, params, attention="sdpa", static_shapes=False)
        graphs = _tokens(model, prompts, params, attention="sdpa", static_shapes=True)   # SDPA graphs: forced
        report[f"fp32_{name}_graphs_vs_eager"] = _agreement(graphs, eager)
    half = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device=device)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    # What the job's lossless audit (audit.fraction) reports on a bf16 run: speculative vs plain AR.
    report["bf16_greedy_speculative_vs_ar"] = _agreement(
        _tokens(half, prompts, params, attention="sdpa", speculative=True),
        _tokens(half, prompts, params, attention="sdpa", speculative=False))
    if flash.unavailable_reason(torch.device(device), torch.bfloat16) is None:
        eager = _tokens(half, prompts, params, attention="sdpa", static_shapes=False)
        fast = _tokens(half, prompts, params, attention="flash", static_shapes=True)
        report["bf16_greedy_flash_graphs_vs_eager"] = _agreement(fast, eager)
    else:
        report["flash"] = f"not run: {flash.unavailable_reason(torch.device(device), torch.bfloat16)}"
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **exactness(args.model, args.prompts)}
    report["exactness_seconds"] = time.perf_counter() - start
    print(json.dumps(report, indent=2), flush=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    if not args.skip_bench:
        bench.main(["--device", "cuda", "--no-job", "--reps", "3", "--out", str(out / "bench-cuda.json")])
        if flash.kernel() is None:   # graphs are opt-in with SDPA: measure what they buy at small B
            bench.main(["--device", "cuda", "--no-job", "--reps", "3", "--cuda-graphs", "--batch-sizes", "1,8",
                        "--modes", "orthrus,ar", "--out", str(out / "bench-cuda-sdpa-graphs.json")])


if __name__ == "__main__":
    main()
