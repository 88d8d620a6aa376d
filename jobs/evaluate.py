"""Held-out acceptance of an Orthrus checkpoint: tokens per cycle per block size and temperature.

    python -m jobs.evaluate --model models/tiny-orthrus-py --prompts examples/shards --n 64

Prompts are the ``prompt`` column (completion style, tokenised without special tokens). Prints one
line per (block size, temperature) and writes the full numbers (histograms, per-position
acceptance) as JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusForCausalLM
from orthrus_train.trainer import acceptance


@torch.no_grad()
def second_position_oracle(model: OrthrusForCausalLM, prompts: list[list[int]], new_tokens: int = 32,
                           top: int = 16) -> float:
    """Acceptance of draft 2 by the best possible drafter that, like Orthrus, does not see draft 1.

    Such a drafter can at best propose the argmax of the AR model's *marginal* over position n+2,
    ``sum_c p(c | x_<=n) p(. | x_<=n, c)`` (here over the top-``top`` candidates c). How often that
    equals the greedy token bounds the diffusion view's position-2 acceptance by the base model's
    own uncertainty, whatever the training.
    """
    from orthrus import OrthrusEngine, SamplingParams
    engine = OrthrusEngine(model, max_batch_size=16)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens), speculative=False)
    hits = total = 0
    for prompt, gen in zip(prompts, gens):
        seq = prompt + gen.token_ids
        for n in range(len(prompt), len(seq) - 2):
            p1 = model(torch.tensor([seq[: n + 1]]))[0, -1].softmax(-1)           # x_{n+1} | x_<=n
            probs, cands = p1.topk(top)
            rows = torch.tensor([seq[: n + 1] + [int(c)] for c in cands])
            p2 = model(rows)[:, -1].softmax(-1)                                  # x_{n+2} | x_<=n, c
            marginal = (probs[:, None] * p2).sum(0)
            hits += int(marginal.argmax()) == seq[n + 2]
            total += 1
    return hits / max(total, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards")
    ap.add_argument("--n", type=int, default=64, help="number of prompts (the first n)")
    ap.add_argument("--block-sizes", default="8,16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--oracle", type=int, default=0, help="also bound position-2 acceptance on this many prompts")
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = OrthrusForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompts = load_prompt_ids(tok, args.prompts, args.n)
    rows = []
    for k in (int(x) for x in args.block_sizes.split(",")):
        for t in (float(x) for x in args.temperatures.split(",")):
            r = acceptance(model, prompts, k, args.max_new_tokens, temperature=t)
            rows.append(r)
            print(f"K={k:<3} T={t:<4} tokens/cycle={r['tokens_per_cycle']:.3f}  TPF={r['tokens_per_cycle'] / 2:.3f}  "
                  f"per-position acceptance={r['per_position_acceptance'][:6]}", flush=True)
    report = {"model": args.model, "prompts": len(prompts), "results": rows}
    if args.oracle:
        report["position2_oracle"] = second_position_oracle(model, prompts[: args.oracle])
        print(f"position-2 acceptance bound (marginal-argmax drafter): {report['position2_oracle']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
