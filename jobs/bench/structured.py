"""Structured output: what grammar constraints cost the engine, and whether every completion is valid.

    python -m jobs.bench structured             # writes bench-results/structured.json

The bundled model in float32 on the held-out prompts, ``--threads`` torch threads (one by default:
on a shared CPU other processes' load stalls torch's thread pool). Row ``i`` of a timed run is
held-out prompt ``i`` and, when constrained, ``jobs/structured_suite.SUITE[i % 23]`` (the suite's
schemas, patterns, choices and grammars in turn); ``--rows`` rows flow through ``B`` slots.

Sections (every mode of one batch size runs in the same rounds, in rotating order; round 0 is a
warm-up; cells are medians of ``--reps`` rounds; ratios are given as the ratio of the medians and
as the median of the per-round ratios, whose two runs shared the machine's load):

1. ``constrained`` ÷ ``free``: tokens/s (generated tokens ÷ wall time: a constrained row stops
   where its grammar is complete, usually long before ``--max-new-tokens``) and tokens per cycle,
   speculative, greedy, at each ``--batch-sizes`` B. Also ms per iteration (a cycle or AR step over
   the batch) and the mean rows per iteration, which separate a constrained cycle's extra host work
   from the batch draining sooner. ``free_matched``: the same rows free, each with the
   ``max_new_tokens`` its constrained run generated (the same lengths, so the batch drains alike):
   ``constrained`` ÷ ``free_matched`` is what the constraints themselves cost.
2. ``constrained`` ÷ ``constrained_ar`` (speculative=False) tokens/s; the greedy tokens must be
   equal (asserted). ``free_ar`` gives the same ratio without constraints, and ``free_plain`` (an
   engine built without a tokenizer, which can constrain no row) checks that rows without a constraint
   cost nothing extra on an engine that can constrain.
3. ``mixed`` at ``--mixed-batch-size``: even rows constrained, odd rows free. Its free rows' tokens
   must equal theirs in the all-free run (asserted); tokens/s ÷ the all-free batch's.
4. Validation: every suite case × ``--validate-prompts`` held-out prompts, greedy and seeded
   sampling (``--temperature``), speculative: rows ending "stop" checked with
   ``structured_suite.valid`` (independent validators; 100% expected, invalid rows listed), rows
   ending "length" counted apart; per kind and per case.

Also, per batch size: device→host reads per iteration of each mode (an unconstrained iteration's
budget is 1; a constrained cycle reads its drafts back once more), and a time split of warm runs
of each speculative mode (medians of up to 3; per iteration: draft / verify forwards, LM head,
prefill, the grammar's host work — masks along the drafted path, matcher advance, admission —
the device-side masking, and the rest: the engine's named ranges read from a ``torch.profiler``
profile of the run, ``profile.py``). Every check is recorded under ``checks``; the report is written, then a
failed check raises.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict

import torch

from jobs.bench import common
from jobs.bench.common import med
from jobs.bench.profile import PARTS, profiled
from jobs.bench.structured_print import print_batch, print_summary, print_validation
from jobs.structured_suite import SUITE, Case, valid
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams, tokens_per_cycle

SPECULATIVE_MODES = ("free", "constrained", "mixed")     # the modes that are timed split by part
MODES = ("free", "constrained", "constrained_ar", "free_matched", "free_ar", "free_plain", "mixed")


def kind(case: Case) -> str:
    """The case's constraint kind (json_schema, regex, choice, grammar)."""
    return next(iter(case.structured))


def case_of(i: int) -> Case:
    """The suite case of row ``i`` (the suite in turn)."""
    return SUITE[i % len(SUITE)]


def row_params(mode: str, rows: int, max_new: int, matched: list[int] | None = None) -> list[SamplingParams]:
    """Greedy params of a timed run's rows: row i constrained by ``case_of(i)`` where the mode says;
    ``free_matched`` rows are free with row i's ``max_new_tokens`` = ``matched[i]``."""
    def constrained(i: int) -> bool:
        return mode in ("constrained", "constrained_ar") or (mode == "mixed" and i % 2 == 0)
    if mode == "free_matched":
        return [SamplingParams(max_new_tokens=matched[i]) for i in range(rows)]
    return [SamplingParams(max_new_tokens=max_new, structured=case_of(i).structured if constrained(i) else None)
            for i in range(rows)]


def speculative_of(mode: str) -> bool:
    """Whether ``mode`` decodes speculatively (the ``_ar`` modes do not)."""
    return not mode.endswith("_ar")


def text_of(tok, ids: list[int]) -> str:
    """The completion as the job writes it (``pipeline/actor/postprocess.py``: special tokens dropped)."""
    return tok.decode(ids, skip_special_tokens=True)


def run_mode(engine: OrthrusEngine, tok, prompts: list[list[int]], mode: str, max_new: int,
             matched: list[int] | None = None) -> dict:
    """One timed greedy ``generate`` of ``mode`` → the cell (with the token ids under ``ids``)."""
    params = row_params(mode, len(prompts), max_new, matched)
    it0, busy0 = engine.stats.iterations, engine.stats.busy_slot_iterations
    seconds, outs = common.time_generate(engine, prompts, params, speculative_of(mode))
    iters, busy = engine.stats.iterations - it0, engine.stats.busy_slot_iterations - busy0
    tokens = sum(len(o.token_ids) for o in outs)
    row_iters = sum(o.stats.num_cycles + o.stats.num_ar_steps for o in outs)
    cell = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tokens_per_cycle": tokens_per_cycle(sum(o.stats.num_accepted_draft_tokens for o in outs), row_iters),
            "iterations": iters, "ms_per_iteration": 1000 * seconds / max(1, iters),
            "rows_per_iteration": busy / max(1, iters),
            "stop_rows": sum(o.finish_reason == "stop" for o in outs),
            "length_rows": sum(o.finish_reason == "length" for o in outs),
            "ids": [o.token_ids for o in outs]}
    checked = [(case_of(i), o) for i, (p, o) in enumerate(zip(params, outs))
               if p.structured is not None and o.finish_reason == "stop"]
    cell["constrained_stop_rows_invalid"] = sum(not valid(c, text_of(tok, o.token_ids)) for c, o in checked)
    if mode == "mixed":     # tokens per cycle of each half
        for half, r in (("constrained", 0), ("free", 1)):
            part = [o for i, o in enumerate(outs) if i % 2 == r]
            cell[f"{half}_rows_tokens_per_cycle"] = tokens_per_cycle(
                sum(o.stats.num_accepted_draft_tokens for o in part),
                sum(o.stats.num_cycles + o.stats.num_ar_steps for o in part))
    return cell


def split_run(engine: OrthrusEngine, tok, prompts: list[list[int]], mode: str, max_new: int) -> dict:
    """One run of ``mode`` under the profiler → ms per iteration and share of the run by part."""
    cuda = next(engine.model.parameters()).is_cuda
    cell, seconds = profiled(lambda: run_mode(engine, tok, prompts, mode, max_new), cuda)
    parts = {p: seconds.get(p, 0.0) for p in PARTS[:-1]}
    parts["rest"] = cell["seconds"] - sum(parts.values())
    iters = max(1, cell["iterations"])
    return {"seconds": cell["seconds"], "iterations": cell["iterations"],
            "ms_per_iteration": {p: 1000 * s / iters for p, s in parts.items()},
            "share": {p: s / cell["seconds"] for p, s in parts.items()}}


# (name, numerator mode, denominator mode, key) of each ratio a batch size reports
RATIOS = (("constrained_over_free tokens_per_s", "constrained", "free", "tokens_per_s"),
          ("constrained_over_free tokens_per_cycle", "constrained", "free", "tokens_per_cycle"),
          ("constrained_over_free ms_per_iteration", "constrained", "free", "ms_per_iteration"),
          ("constrained_over_free_matched tokens_per_s", "constrained", "free_matched", "tokens_per_s"),
          ("constrained_over_free_matched ms_per_iteration", "constrained", "free_matched", "ms_per_iteration"),
          ("constrained_speculative_over_ar tokens_per_s", "constrained", "constrained_ar", "tokens_per_s"),
          ("free_speculative_over_ar tokens_per_s", "free", "free_ar", "tokens_per_s"),
          ("free_over_free_plain tokens_per_s", "free", "free_plain", "tokens_per_s"),
          ("mixed_over_free tokens_per_s", "mixed", "free", "tokens_per_s"),
          ("mixed_over_free ms_per_iteration", "mixed", "free", "ms_per_iteration"))
# (check, mode a, mode b, rows compared) of the token equalities between modes
SAME_TOKENS = (("constrained greedy tokens: speculative == AR", "constrained", "constrained_ar", "all"),
               ("free greedy tokens: speculative == AR", "free", "free_ar", "all"),
               ("free tokens: engine with tokenizer == without", "free", "free_plain", "all"),
               ("free_matched rows: prefixes of the free rows", "free_matched", "free", "prefix"),
               ("mixed batch: free rows == all-free run", "mixed", "free", "odd"),
               ("mixed batch: constrained rows == all-constrained run", "mixed", "constrained", "even"))


def ratios_of(cells: dict, samples: dict) -> dict:
    """Every ratio of ``RATIOS`` whose two modes ran: of the medians and the median of the pair ratios."""
    return {name: {"ratio_of_medians": cells[a][key] / cells[b][key],
                   "median_of_pair_ratios": common.pair_ratio(samples[a], samples[b], key)}
            for name, a, b, key in RATIOS if a in cells and b in cells}


def token_checks(ids: dict[str, list]) -> dict[str, bool]:
    """Every equality of ``SAME_TOKENS`` whose two modes ran."""
    def same(x: list, y: list, rows: str) -> bool:
        if rows == "prefix":
            return all(m == f[: len(m)] for m, f in zip(x, y))
        step = {"all": slice(None), "odd": slice(1, None, 2), "even": slice(None, None, 2)}[rows]
        return x[step] == y[step]
    return {name: same(ids[a], ids[b], rows) for name, a, b, rows in SAME_TOKENS if a in ids and b in ids}


def time_split(engine: OrthrusEngine, tok, prompts: list[list[int]], modes: list[str],
               args: argparse.Namespace) -> dict:
    """Each speculative mode's time by part: medians of up to 3 interleaved profiled runs (a loaded
    machine skews one)."""
    split_modes = [m for m in modes if m in SPECULATIVE_MODES]
    runs: dict[str, list[dict]] = {m: [] for m in split_modes}
    for _ in range(max(1, min(3, args.reps))):
        for m in split_modes:
            runs[m].append(split_run(engine, tok, prompts, m, args.max_new_tokens))
    return {m: {"runs": len(r), "seconds": med(r, "seconds"), "iterations": r[0]["iterations"],
                **{key: {p: statistics.median(x[key][p] for x in r) for p in PARTS}
                   for key in ("ms_per_iteration", "share")}}
            for m, r in runs.items()}


def bench_batch(model: OrthrusForCausalLM, tok, prompts: list[list[int]], b: int, modes: list[str],
                args: argparse.Namespace) -> dict:
    """Interleaved rounds of ``modes`` at ``b`` slots → medians, ratios, checks, host reads, time split."""
    seq = min(1024, model.config.max_position_embeddings)
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=seq, static_shapes=False, tokenizer=tok)
    plain = OrthrusEngine(model, max_batch_size=b, max_seq_len=seq, static_shapes=False)   # no tokenizer
    engine_of = {m: plain if m == "free_plain" else engine for m in modes}
    matched = None
    if "free_matched" in modes:       # the constrained rows' lengths (an extra warm-up run)
        matched = [len(t) for t in run_mode(engine, tok, prompts, "constrained", args.max_new_tokens)["ids"]]
    r = common.rounds({m: (lambda m=m: run_mode(engine_of[m], tok, prompts, m, args.max_new_tokens, matched))
                       for m in modes}, args.reps)                 # rotating order, round 0 a warm-up
    samples, ids = r.samples, {m: got[0] for m, got in r.ids.items()}
    cells: dict = {m: {k: med(s, k) for k in s[0]} for m, s in samples.items()}
    for m, s in samples.items():
        cells[m]["tokens"] = s[0]["tokens"]
    checks = {f"{m} tokens repeat every round": r.repeatable(m) for m in modes}
    checks.update(token_checks(ids))
    for m in modes:
        if m in ("constrained", "constrained_ar", "mixed"):
            checks[f"{m}: every stop row valid"] = all(c["constrained_stop_rows_invalid"] == 0 for c in samples[m])
    reads = {m: common.host_reads_per_iteration(engine_of[m], lambda m=m: run_mode(
                 engine_of[m], tok, prompts, m, args.max_new_tokens))
             for m in modes if m in ("free", "constrained", "constrained_ar", "mixed")}
    if "free" in reads:
        checks["free: 1 host read per iteration"] = reads["free"] == 1
    report = {"rows": len(prompts), "slots": b, "modes": cells, "ratios": ratios_of(cells, samples),
              "tokens_per_s_by_round": {m: [c["tokens_per_s"] for c in s] for m, s in samples.items()},
              "host_reads_per_iteration": reads, "checks": checks, "ids": ids}
    if args.split:
        report["time_split"] = time_split(engine, tok, prompts, modes, args)
    return report


def validate(model: OrthrusForCausalLM, tok, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Every suite case × ``args.validate_prompts`` evenly spaced held-out prompts, greedy and
    seeded sampling, speculative → counts of stop / valid / length rows per kind and per case."""
    n = min(args.validate_prompts, len(prompts))
    picked = [prompts[j * len(prompts) // n] for j in range(n)]
    engine = OrthrusEngine(model, max_batch_size=args.validate_batch_size, static_shapes=False, tokenizer=tok,
                           max_seq_len=min(1024, model.config.max_position_embeddings))
    rows = [(c, j) for c in SUITE for j in range(n)]
    report: dict = {"prompts": n, "cases": len(SUITE), "max_new_tokens": args.validate_max_new_tokens,
                    "slots": args.validate_batch_size, "temperature": args.temperature}
    start = time.perf_counter()
    invalid: list[dict] = []
    by_kind: dict = defaultdict(Counter)
    by_case: dict = defaultdict(Counter)
    for sampling in ("greedy", "sampled"):
        params = [SamplingParams(max_new_tokens=args.validate_max_new_tokens, structured=c.structured,
                                 temperature=0.0 if sampling == "greedy" else args.temperature, seed=i + 1)
                  for i, (c, _) in enumerate(rows)]
        outs = engine.generate([picked[j] for _, j in rows], params, speculative=True)
        for (case, j), o in zip(rows, outs):
            cell = Counter(rows=1)
            if o.finish_reason == "stop":
                text = text_of(tok, o.token_ids)
                ok = valid(case, text)
                cell.update(stop=1, stop_valid=int(ok))
                if not ok:
                    invalid.append({"case": case.name, "prompt": j, "sampling": sampling, "text": text})
            else:
                cell.update(length=1)
            for key in ((kind(case), sampling), (kind(case), "all"), ("all", sampling), ("all", "all")):
                by_kind[key].update(cell)
            by_case[case.name].update(cell)
    def fractions(c: Counter) -> dict:
        out = {k: c[k] for k in ("rows", "stop", "stop_valid", "length")}
        out["stop_valid_fraction"] = c["stop_valid"] / c["stop"] if c["stop"] else None
        return out
    order = list(dict.fromkeys([kind(c) for c in SUITE] + ["all"]))
    report["by_kind"] = {k: {s: fractions(by_kind[k, s]) for s in ("greedy", "sampled", "all")} for k in order}
    report["by_case"] = {name: fractions(c) for name, c in by_case.items()}
    report["invalid"] = invalid
    report["seconds"] = time.perf_counter() - start
    report["checks"] = {"every stop row valid": not invalid}
    return report


def add_args(ap) -> None:
    """The structured workload's own arguments (batch sizes 1,16 and one thread by default)."""
    ap.add_argument("--rows", type=int, default=2 * len(SUITE),
                    help="rows per timed run, flowing through the B slots (default: each suite case twice)")
    ap.add_argument("--modes", default=",".join(MODES[:-1]),
                    help="modes of the timed rounds ('mixed' is added at --mixed-batch-size)")
    ap.add_argument("--mixed-batch-size", type=int, default=16, help="B of the mixed batch (0 skips it)")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                    help="time warm runs of each speculative mode by part (median of up to 3)")
    ap.add_argument("--validate-prompts", type=int, default=16, help="held-out prompts per suite case (0 skips)")
    ap.add_argument("--validate-max-new-tokens", type=int, default=64)
    ap.add_argument("--validate-batch-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="of the seeded sampled validation rows")
    ap.set_defaults(batch_sizes="1,16", threads=1)


def engine_version() -> dict:
    """The commit the engine ran at and whether ``orthrus/`` had uncommitted changes (None outside git)."""
    import subprocess
    root = common.REPO
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return {"commit": None, "orthrus_dirty": None}
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "orthrus"],
                           capture_output=True, text=True).stdout.strip()
    return {"commit": head.stdout.strip(), "orthrus_dirty": bool(dirty)}


def run(args: argparse.Namespace) -> dict:
    """Every section → the report (printed as it goes; token ids left out)."""
    common.set_threads(args)
    start = time.perf_counter()
    tok, held_out = common.load_prompts(args.model, args.prompts)
    model = common.load_model(args.model)
    prompts = [held_out[i % len(held_out)] for i in range(args.rows)]
    sizes = common.batch_sizes(args, "1,16")
    modes = [m for m in args.modes.split(",") if m]
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "reps": args.reps, "rows": args.rows,
                    "max_new_tokens": args.max_new_tokens, "block_size": model.block_size, "greedy": True,
                    "suite_cases": len(SUITE), "settings": vars(args), "engine": engine_version(),
                    "results": {}, "checks": {}}
    plan = [(b, modes + (["mixed"] if b == args.mixed_batch_size else [])) for b in sizes]
    if args.mixed_batch_size and args.mixed_batch_size not in sizes:
        plan.append((args.mixed_batch_size, ["free", "mixed"]))
    ids_by_b: dict[int, dict] = {}
    for b, batch_modes in plan:
        cells = bench_batch(model, tok, prompts, b, batch_modes, args)
        ids_by_b[b] = cells.pop("ids")
        report["results"][str(b)] = cells
        report["checks"].update({f"B={b}: {k}": v for k, v in cells["checks"].items()})
        print_batch(b, cells)
    with_constrained = [b for b in ids_by_b if "constrained" in ids_by_b[b]]
    for b in with_constrained[1:]:
        a = with_constrained[0]
        same = ids_by_b[a]["constrained"] == ids_by_b[b]["constrained"]
        report["checks"][f"constrained tokens: B={a} == B={b}"] = same
    if args.validate_prompts:
        report["validation"] = validate(model, tok, held_out, args)
        report["checks"]["validation: every stop row valid"] = report["validation"]["checks"]["every stop row valid"]
        print_validation(report["validation"])
    report["seconds"] = time.perf_counter() - start
    return report


def main(args: argparse.Namespace) -> None:
    """Every section → ``bench-results/structured.json``; then a failed check raises."""
    report = run(args)
    print_summary(report)
    common.write_report(args, report)
    print(f"total {report['seconds']:.0f} s", flush=True)
    failed = [k for k, ok in report["checks"].items() if not ok]
    assert not failed, f"structured bench checks failed: {failed}"
