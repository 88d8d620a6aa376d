"""Reasoning rows: thinking on with a JSON schema, speculative ÷ AR and constrained ÷ free, one run.

    python -m jobs.bench reasoning            # writes bench-results/reasoning.json

The bundled model in float32 on the held-out prompts, each followed by a think-start token, so every
row starts in its reasoning phase. The bundled model has no think tokens of its own and never closes
a block by itself: two of its ids stand in for ``<think>`` / ``</think>`` and a thinking budget
(``--thinking-budget``) closes every row's thinking, after which the answer is free (``free``) or a
JSON schema's (``json``, the suite's ``person`` case: its grammar starts after the think end).
Modes ``<answer>_<spec|ar>`` run in the same rounds in rotating order (round 0 a warm-up; cells are
medians of ``--reps``; ratios as the ratio of medians and the median of per-round ratios). Greedy, so
speculative and AR must give the same tokens (checked), and every stopped JSON answer must validate.
"""
from __future__ import annotations

import argparse

import torch

from jobs.bench import common
from jobs.bench.common import med, pair_ratio
from jobs.structured_suite import SUITE, valid
from orthrus import OrthrusEngine, ReasoningTokens, SamplingParams

THINK = ReasoningTokens(start=100, end=39, separator=(198,))    # stand-ins in the bundled vocabulary
PERSON = next(c for c in SUITE if c.name == "person")
MODES = ("free_spec", "free_ar", "json_spec", "json_ar")


def _params(mode: str, rows: int, args: argparse.Namespace) -> list[SamplingParams]:
    structured = PERSON.structured if mode.startswith("json") else None
    return [SamplingParams(max_new_tokens=args.max_new_tokens, max_thinking_tokens=args.thinking_budget,
                           structured=structured) for _ in range(rows)]


def _cell(engine: OrthrusEngine, prompts: list[list[int]], mode: str, args: argparse.Namespace) -> dict:
    seconds, outs = common.time_generate(engine, prompts, _params(mode, len(prompts), args),
                                         speculative=mode.endswith("spec"))
    tokens = sum(len(o.token_ids) for o in outs)
    thought = sum(o.num_reasoning_tokens for o in outs)
    spec = [o.stats for o in outs if o.stats.num_cycles]
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "reasoning_tokens": thought,
            "reasoning_tokens_per_cycle": sum(s.reasoning_tokens_per_cycle for s in spec) / max(1, len(spec)),
            "answer_tokens_per_cycle": sum(s.answer_tokens_per_cycle for s in spec) / max(1, len(spec)),
            "ids": [o.token_ids for o in outs], "outs": outs}


def run(args: argparse.Namespace) -> dict:
    """Every mode at each batch size → the report (printed as it goes)."""
    tok, prompts = common.load_prompts(args.model, args.prompts)
    model = common.load_model(args.model)
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "reps": args.reps,
                    "thinking_budget": args.thinking_budget, "max_new_tokens": args.max_new_tokens,
                    "schema": PERSON.structured, "results": {}, "checks": {}}
    for b in common.batch_sizes(args, "8"):
        rows = [prompts[i % len(prompts)] + [THINK.start] for i in range(max(b, args.min_rows))]
        engine = OrthrusEngine(model, max_batch_size=b, tokenizer=tok, reasoning=THINK)
        last: dict[str, dict] = {}

        def runner(mode: str):
            def go() -> dict:
                cell = _cell(engine, rows, mode, args)
                last[mode] = {"outs": cell.pop("outs")}
                return cell
            return go
        r = common.rounds({m: runner(m) for m in MODES}, args.reps)
        s = r.samples
        cell = {m: {k: med(s[m], k) for k in ("tokens_per_s", "tokens", "reasoning_tokens",
                                               "reasoning_tokens_per_cycle", "answer_tokens_per_cycle")} for m in MODES}
        for answer in ("free", "json"):
            cell[f"{answer}_spec_over_ar"] = {"medians": med(s[f"{answer}_spec"], "tokens_per_s") / med(s[f"{answer}_ar"], "tokens_per_s"),
                                              "pairs": pair_ratio(s[f"{answer}_spec"], s[f"{answer}_ar"], "tokens_per_s")}
        for mode in ("spec", "ar"):
            cell[f"json_over_free_{mode}"] = {"medians": med(s[f"json_{mode}"], "tokens_per_s") / med(s[f"free_{mode}"], "tokens_per_s"),
                                              "pairs": pair_ratio(s[f"json_{mode}"], s[f"free_{mode}"], "tokens_per_s")}
        stopped = [o for o in last["json_spec"]["outs"] if o.finish_reason == "stop"]
        report["checks"][f"B={b}"] = {
            "spec_equals_ar": r.ids["free_spec"] == r.ids["free_ar"] and r.ids["json_spec"] == r.ids["json_ar"],
            "json_answers_stopped": len(stopped), "json_answers_valid": sum(
                valid(PERSON, tok.decode(o.token_ids[o.num_reasoning_tokens:-1])) for o in stopped)}
        report["results"][f"B={b}"] = cell
        print(f"B={b}: free spec/AR ×{cell['free_spec_over_ar']['medians']:.2f}, json spec/AR "
              f"×{cell['json_spec_over_ar']['medians']:.2f}, json/free spec ×{cell['json_over_free_spec']['medians']:.2f}, "
              f"AR ×{cell['json_over_free_ar']['medians']:.2f}; tokens per cycle thinking "
              f"{cell['json_spec']['reasoning_tokens_per_cycle']:.2f}, answer {cell['json_spec']['answer_tokens_per_cycle']:.2f}; "
              f"checks {report['checks'][f'B={b}']}", flush=True)
    return report


def add_args(ap) -> None:
    """Its own: the thinking budget; defaults B = 8, 3 reps, 96 new tokens, one thread."""
    ap.add_argument("--thinking-budget", type=int, default=32, help="reasoning tokens before the think end is forced")
    ap.set_defaults(batch_sizes="8", reps=3, max_new_tokens=96, threads=1)


def main(args: argparse.Namespace) -> None:
    """Every mode × ``--batch-sizes`` → ``bench-results/reasoning.json``; a failed check raises."""
    common.set_threads(args)
    report = run(args)
    common.write_report(args, report)
    for b, checks in report["checks"].items():
        if not checks["spec_equals_ar"] or checks["json_answers_valid"] != checks["json_answers_stopped"]:
            raise SystemExit(f"reasoning bench check failed at {b}: {checks}")
