"""A verify budget per cycle: drafts verified per accepted one, tokens per cycle and tokens/s, against
verifying every draft and against our AR mode, in ONE process.

    python -m jobs.bench verify                     # B = 32, 64; bench-results/verify.json

The bundled model's held-out prompts (repeated to ``B`` rows), greedy, ``--max-new-tokens`` each,
forced speculation with its block size K, float32. Arms, interleaved (``--reps`` rounds after a
warm-up, rotating order): ``ar`` (our AR mode), ``full`` (``adaptive_verify=False``: every draft),
``adaptive`` (the engine's default: the verify policy picks the budget from measured step costs)
and ``eighths_4/3/2/1`` (the budget pinned to 4/8 … 1/8 of the drafts, ``orthrus.testing.pinned``):
the trade-off the policy chooses on. Reported per arm: tokens/s (median), its pair ratio to ``full``
and to ``ar`` (same round), tokens per cycle, verified ÷ accepted drafts, forward token positions
per generated token, and for ``adaptive`` the budgets its policy chose. Completions must equal AR's.
"""
from __future__ import annotations

import argparse

from jobs.bench import common
from jobs.bench.common import med, pair_ratio
from orthrus import OrthrusEngine, SamplingParams
from orthrus.metrics import tokens_per_cycle
from orthrus.testing.pinned import pin

PINNED = (4, 3, 2, 1)


def run_arm(engine: OrthrusEngine, prompts: list[list[int]], max_new: int, speculative: bool) -> dict:
    """One timed ``generate`` → tokens/s, tokens per cycle, verified ÷ accepted, positions per token."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    before = engine.stats
    seconds, res = common.time_generate(engine, prompts, params, speculative)
    stats = engine.stats - before
    tokens = sum(len(r.token_ids) for r in res)
    cycles = sum(r.stats.num_cycles for r in res)
    accepted = sum(r.stats.num_accepted_draft_tokens for r in res)
    verified = sum(r.stats.num_verified_draft_tokens for r in res)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens,
            "tokens_per_cycle": tokens_per_cycle(accepted, cycles) if cycles else None,
            "verified_per_accepted": verified / accepted if accepted else None,
            "verified_drafts_per_cycle_row": verified / cycles if cycles else None,
            "forward_positions_per_token": stats.forward_token_slots / tokens,
            "ids": [r.token_ids for r in res]}


def bench_batch(b: int, args: argparse.Namespace, model, prompts: list[list[int]]) -> dict:
    """Every arm at ``b`` slots (b rows), interleaved → the cell."""
    rows = [prompts[i % len(prompts)] for i in range(b)]

    def engine(adaptive: bool = True, eighths: int | None = None) -> OrthrusEngine:
        e = OrthrusEngine(model, max_batch_size=b, static_shapes=False, adaptive_verify=adaptive)
        return pin(e, eighths)
    engines = {"ar": engine(), "full": engine(adaptive=False), "adaptive": engine(),
               **{f"eighths_{e}": engine(eighths=e) for e in PINNED}}
    runs = {name: (lambda name=name: run_arm(engines[name], rows, args.max_new_tokens, name != "ar"))
            for name in engines}
    r = common.rounds(runs, args.reps)
    cell: dict = {}
    for name in engines:
        s = r.samples[name]
        cell[name] = {"tokens_per_s": med(s, "tokens_per_s"),
                      "vs_full": pair_ratio(s, r.samples["full"], "tokens_per_s"),
                      "vs_ar": pair_ratio(s, r.samples["ar"], "tokens_per_s"),
                      **{k: s[-1][k] for k in ("tokens_per_cycle", "verified_per_accepted",
                                                "verified_drafts_per_cycle_row", "forward_positions_per_token")}}
    chosen: dict[str, int] = {}
    for policy in engines["adaptive"].scheduler.speculation.verify_policies.values():   # one per block size run
        for arm, n in policy.chosen.items():
            chosen[str(arm)] = chosen.get(str(arm), 0) + n
    cell["adaptive"]["chosen_eighths"] = chosen
    cell["identical_to_ar"] = all(r.ids[n][-1] == r.ids["ar"][-1] for n in engines)
    return cell


def cycle_costs(model, prompts: list[list[int]], batch_sizes: list[int], block: int, max_new: int,
                reps: int) -> dict:
    """Seconds per cycle of forced speculation at ``block`` verifying every draft, 3/8 and 2/8 of
    them (pinned), and per AR step, B rows through B slots, interleaved (``jobs.gpu_check``'s
    ``bench_verify``: on random weights nothing is accepted, so only the costs mean anything)."""
    out: dict = {}
    for b in batch_sizes:
        rows = [prompts[i % len(prompts)] for i in range(b)]
        engines = {name: pin(OrthrusEngine(model, max_batch_size=b, block_size=block, max_seq_len=1024,
                                           adaptive_verify=name != "full"), eighths)
                   for name, eighths in (("full", None), ("eighths_3", 3), ("eighths_2", 2))}
        engines["ar"] = OrthrusEngine(model, max_batch_size=b, block_size=block, max_seq_len=1024)

        def timed(name: str) -> dict:
            engine = engines[name]
            before = engine.stats
            seconds, _ = common.time_generate(engine, rows, SamplingParams(temperature=0.0, max_new_tokens=max_new),
                                              name != "ar")
            stats = engine.stats - before
            return {"s_per_iteration": seconds / max(stats.iterations, 1),
                    "forward_positions_per_iteration": stats.forward_token_slots / max(stats.iterations, 1)}
        r = common.rounds({name: (lambda name=name: timed(name)) for name in engines}, reps)
        cell = {name: {k: med(r.samples[name], k) for k in r.samples[name][0]} for name in engines}
        for name in engines:
            cell[name]["R_vs_ar_step"] = pair_ratio(r.samples[name], r.samples["ar"], "s_per_iteration")
        out[f"B={b}"] = cell
    return out


def _line(b: int, name: str, c: dict) -> str:
    tpc, vpa = c["tokens_per_cycle"], c["verified_per_accepted"]
    return (f"B={b:<3} {name:<10} {c['tokens_per_s']:7.1f} tok/s  x{c['vs_full']:.2f} full  x{c['vs_ar']:.2f} AR  "
            f"TPC {tpc if tpc is None else round(tpc, 2)}  verified/accepted {vpa if vpa is None else round(vpa, 2)}  "
            f"positions/token {c['forward_positions_per_token']:.2f}")


def run(args: argparse.Namespace) -> dict:
    """Each batch size's arms → the report (printed as it goes)."""
    model = common.load_model(args.model)
    prompts = common.load_prompts(args.model, args.prompts)[1]
    report = {"model": args.model, "block_size": model.block_size, "max_new_tokens": args.max_new_tokens,
              "reps": args.reps, "results": {}}
    for b in common.batch_sizes(args, "32,64"):
        cell = report["results"][f"B={b}"] = bench_batch(b, args, model, prompts)
        for name, c in cell.items():
            if isinstance(c, dict) and "tokens_per_s" in c:
                print(_line(b, name, c), flush=True)
        print(f"B={b:<3} adaptive chose (eighths: iterations) {cell['adaptive']['chosen_eighths']}; "
              f"completions identical to AR: {cell['identical_to_ar']}", flush=True)
    return report


def add_args(ap) -> None:
    """This workload's defaults."""
    ap.set_defaults(batch_sizes="32,64", max_new_tokens=48, reps=3)


def main(args: argparse.Namespace) -> None:
    """The verify-budget report → ``bench-results/verify.json``."""
    common.set_threads(args)
    common.write_report(args, run(args))
