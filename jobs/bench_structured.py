"""Structured output: what grammar constraints cost the engine, and whether every completion is valid.

    python -m jobs.bench --only structured      # writes bench_structured.json next to --out
    python -m jobs.bench_structured --out bench_structured.json

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
the device-side masking, and the rest). Every check is recorded under ``checks``; the report is written, then a
failed check raises.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from jobs.part_timer import PARTS, PartTimer
from jobs.prompt_ids import load_prompt_ids
from jobs.structured_suite import SUITE, Case, valid
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams, tokens_per_cycle
from orthrus.testing.host_syncs import count_host_reads, host_reads

SPECULATIVE_MODES = ("free", "constrained", "mixed")     # the modes that are timed split by part
MODES = ("free", "constrained", "constrained_ar", "free_matched", "free_ar", "free_plain", "mixed")


def kind(case: Case) -> str:
    return next(iter(case.structured))


def case_of(i: int) -> Case:
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
    return not mode.endswith("_ar")


def text_of(tok, ids: list[int]) -> str:
    """The completion as the job writes it (``pipeline/actor/postprocess.py``: special tokens dropped)."""
    return tok.decode(ids, skip_special_tokens=True)


def run_mode(engine: OrthrusEngine, tok, prompts: list[list[int]], mode: str, max_new: int,
             matched: list[int] | None = None) -> dict:
    """One timed greedy ``generate`` of ``mode`` → the cell (with the token ids under ``ids``)."""
    params = row_params(mode, len(prompts), max_new, matched)
    it0, busy0 = engine.stats.iterations, engine.stats.busy_slot_iterations
    start = time.perf_counter()
    outs = engine.generate(prompts, params, speculative=speculative_of(mode))
    seconds = time.perf_counter() - start
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


def med(cells: list[dict], key: str) -> float:
    return statistics.median(c[key] for c in cells)


def pair_ratio(a: list[dict], b: list[dict], key: str) -> float:
    """Median over rounds of a[i][key] ÷ b[i][key] (same round: the same machine load)."""
    return statistics.median(x[key] / y[key] for x, y in zip(a, b))


def split_run(engine: OrthrusEngine, tok, prompts: list[list[int]], mode: str, max_new: int) -> dict:
    """One untimed-by-the-rounds run of ``mode`` with its parts timed → ms per iteration by part."""
    timer = PartTimer(engine)
    try:
        cell = run_mode(engine, tok, prompts, mode, max_new)
    finally:
        timer.restore()
    parts = {p: timer.seconds.get(p, 0.0) for p in PARTS[:-1]}
    parts["rest"] = cell["seconds"] - sum(parts.values())
    iters = max(1, cell["iterations"])
    return {"seconds": cell["seconds"], "iterations": cell["iterations"],
            "ms_per_iteration": {p: 1000 * s / iters for p, s in parts.items()},
            "share": {p: s / cell["seconds"] for p, s in parts.items()}}


def host_reads_per_iteration(engine: OrthrusEngine, tok, prompts: list[list[int]], mode: str, max_new: int) -> float:
    before = engine.stats.iterations
    with count_host_reads() as reads:
        run_mode(engine, tok, prompts, mode, max_new)
    return host_reads(reads) / max(1, engine.stats.iterations - before)


def bench_batch(model: OrthrusForCausalLM, tok, prompts: list[list[int]], b: int, modes: list[str],
                args: argparse.Namespace) -> dict:
    """Interleaved rounds of ``modes`` at ``b`` slots → medians, ratios, checks, host reads, time split."""
    seq = min(1024, model.config.max_position_embeddings)
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=seq, static_shapes=False, tokenizer=tok)
    plain = OrthrusEngine(model, max_batch_size=b, max_seq_len=seq, static_shapes=False)   # no tokenizer
    engine_of = {m: plain if m == "free_plain" else engine for m in modes}
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    ids: dict[str, list] = {}
    matched = None
    if "free_matched" in modes:       # the constrained rows' lengths (an extra warm-up run)
        matched = [len(t) for t in run_mode(engine, tok, prompts, "constrained", args.max_new_tokens)["ids"]]
    repeatable = {m: True for m in modes}          # every round of a mode gave the same tokens
    for rep in range(args.reps + 1):
        for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            cell = run_mode(engine_of[mode], tok, prompts, mode, args.max_new_tokens, matched)
            got = cell.pop("ids")
            repeatable[mode] &= ids.setdefault(mode, got) == got
            if rep:
                samples[mode].append(cell)
    cells: dict = {m: {k: med(s, k) for k in s[0]} for m, s in samples.items()}
    for m, s in samples.items():
        cells[m]["tokens"] = s[0]["tokens"]
    checks: dict[str, bool] = {f"{m} tokens repeat every round": ok for m, ok in repeatable.items()}
    ratios: dict = {}

    def ratio(name: str, a: str, bm: str, key: str = "tokens_per_s") -> None:
        if a in cells and bm in cells:
            ratios[name] = {"ratio_of_medians": cells[a][key] / cells[bm][key],
                            "median_of_pair_ratios": pair_ratio(samples[a], samples[bm], key)}
    ratio("constrained_over_free tokens_per_s", "constrained", "free")
    ratio("constrained_over_free tokens_per_cycle", "constrained", "free", "tokens_per_cycle")
    ratio("constrained_over_free ms_per_iteration", "constrained", "free", "ms_per_iteration")
    ratio("constrained_over_free_matched tokens_per_s", "constrained", "free_matched")
    ratio("constrained_over_free_matched ms_per_iteration", "constrained", "free_matched", "ms_per_iteration")
    ratio("constrained_speculative_over_ar tokens_per_s", "constrained", "constrained_ar")
    ratio("free_speculative_over_ar tokens_per_s", "free", "free_ar")
    ratio("free_over_free_plain tokens_per_s", "free", "free_plain")
    ratio("mixed_over_free tokens_per_s", "mixed", "free")
    ratio("mixed_over_free ms_per_iteration", "mixed", "free", "ms_per_iteration")
    if "constrained" in ids and "constrained_ar" in ids:
        checks["constrained greedy tokens: speculative == AR"] = ids["constrained"] == ids["constrained_ar"]
    if "free" in ids and "free_ar" in ids:
        checks["free greedy tokens: speculative == AR"] = ids["free"] == ids["free_ar"]
    if "free" in ids and "free_plain" in ids:
        checks["free tokens: engine with tokenizer == without"] = ids["free"] == ids["free_plain"]
    if "free_matched" in ids and "free" in ids:
        checks["free_matched rows: prefixes of the free rows"] = all(
            m == f[: len(m)] for m, f in zip(ids["free_matched"], ids["free"]))
    if "mixed" in ids and "free" in ids:
        checks["mixed batch: free rows == all-free run"] = ids["mixed"][1::2] == ids["free"][1::2]
    if "mixed" in ids and "constrained" in ids:
        checks["mixed batch: constrained rows == all-constrained run"] = ids["mixed"][::2] == ids["constrained"][::2]
    for m in modes:
        if m in ("constrained", "constrained_ar", "mixed"):
            checks[f"{m}: every stop row valid"] = all(c["constrained_stop_rows_invalid"] == 0 for c in samples[m])
    reads = {m: host_reads_per_iteration(engine_of[m], tok, prompts, m, args.max_new_tokens)
             for m in modes if m in ("free", "constrained", "constrained_ar", "mixed")}
    if "free" in reads:
        checks["free: 1 host read per iteration"] = reads["free"] == 1
    report = {"rows": len(prompts), "slots": b, "modes": cells, "ratios": ratios,
              "tokens_per_s_by_round": {m: [c["tokens_per_s"] for c in s] for m, s in samples.items()},
              "host_reads_per_iteration": reads, "checks": checks, "ids": ids}
    if args.split:       # medians of up to 3 interleaved runs per mode (a loaded machine skews one)
        split_modes = [m for m in modes if m in SPECULATIVE_MODES]
        runs: dict[str, list[dict]] = {m: [] for m in split_modes}
        for _ in range(max(1, min(3, args.reps))):
            for m in split_modes:
                runs[m].append(split_run(engine, tok, prompts, m, args.max_new_tokens))
        report["time_split"] = {m: {"runs": len(r), "seconds": med(r, "seconds"), "iterations": r[0]["iterations"],
                                    **{key: {p: statistics.median(x[key][p] for x in r) for p in PARTS}
                                       for key in ("ms_per_iteration", "share")}}
                                for m, r in runs.items()}
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-orthrus-py")
    ap.add_argument("--prompts", default="examples/shards", help="held-out Parquet shards (prompt column)")
    ap.add_argument("--batch-sizes", default="1,16", help="comma list of B (slots)")
    ap.add_argument("--rows", type=int, default=2 * len(SUITE),
                    help="rows per timed run, flowing through the B slots (default: each suite case twice)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed rounds after a warm-up (>= 3 for the medians)")
    ap.add_argument("--modes", default=",".join(MODES[:-1]),
                    help="modes of the timed rounds ('mixed' is added at --mixed-batch-size)")
    ap.add_argument("--mixed-batch-size", type=int, default=16, help="B of the mixed batch (0 skips it)")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                    help="time warm runs of each speculative mode by part (median of up to 3)")
    ap.add_argument("--validate-prompts", type=int, default=16, help="held-out prompts per suite case (0 skips)")
    ap.add_argument("--validate-max-new-tokens", type=int, default=64)
    ap.add_argument("--validate-batch-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="of the seeded sampled validation rows")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default=None, help="write the report here (JSON)")
    return ap.parse_args(argv)


def engine_version() -> dict:
    """The commit the engine ran at and whether ``orthrus/`` had uncommitted changes (None outside git)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return {"commit": None, "orthrus_dirty": None}
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "orthrus"],
                           capture_output=True, text=True).stdout.strip()
    return {"commit": head.stdout.strip(), "orthrus_dirty": bool(dirty)}


def run(args: argparse.Namespace) -> dict:
    """Every section → the report (printed as it goes; token ids left out)."""
    from transformers import AutoTokenizer
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = OrthrusForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    held_out = load_prompt_ids(tok, args.prompts)
    prompts = [held_out[i % len(held_out)] for i in range(args.rows)]
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
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


def print_batch(b: int, r: dict) -> None:
    cells, ratios = r["modes"], r["ratios"]
    print(f"B={b}, {r['rows']} rows:", flush=True)
    for m, c in cells.items():
        print(f"  {m:<15} {c['tokens_per_s']:7.0f} tok/s  {c['tokens']:5d} tokens  tpc {c['tokens_per_cycle']:.2f}  "
              f"{c['ms_per_iteration']:6.2f} ms/iteration  {c['rows_per_iteration']:5.2f} rows/iteration  "
              f"stop {c['stop_rows']:.0f} length {c['length_rows']:.0f}  "
              f"host reads/iteration {r['host_reads_per_iteration'].get(m, float('nan')):.2f}", flush=True)
    for name, v in ratios.items():
        print(f"  {name:<46} ×{v['ratio_of_medians']:.3f}  (pairs ×{v['median_of_pair_ratios']:.3f})", flush=True)
    for m, s in r.get("time_split", {}).items():
        print(f"  split {m:<12} ms/iteration: " + "  ".join(f"{p} {ms:.2f}" for p, ms in s["ms_per_iteration"].items()
                                                            if ms >= 0.005 or p == "rest"), flush=True)
    failed = [k for k, ok in r["checks"].items() if not ok]
    print(f"  checks: {len(r['checks']) - len(failed)}/{len(r['checks'])} pass"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)


def print_summary(report: dict) -> None:
    """One line per batch size: the ratios (of medians; median of per-round ratios in brackets)."""
    cols = [("constrained/free tok/s", "constrained_over_free tokens_per_s"),
            ("constrained/free tpc", "constrained_over_free tokens_per_cycle"),
            ("constrained/free_matched tok/s", "constrained_over_free_matched tokens_per_s"),
            ("constrained spec/AR tok/s", "constrained_speculative_over_ar tokens_per_s"),
            ("free spec/AR tok/s", "free_speculative_over_ar tokens_per_s"),
            ("free/free_plain tok/s", "free_over_free_plain tokens_per_s"),
            ("mixed/free tok/s", "mixed_over_free tokens_per_s")]
    print("summary (ratio of medians [median of per-round ratios]):", flush=True)
    for b, r in report["results"].items():
        parts = [f"{label} {r['ratios'][key]['ratio_of_medians']:.2f} [{r['ratios'][key]['median_of_pair_ratios']:.2f}]"
                 for label, key in cols if key in r["ratios"]]
        print(f"  B={b:<3} " + " | ".join(parts), flush=True)
    failed = [k for k, ok in report["checks"].items() if not ok]
    print(f"  checks: {len(report['checks']) - len(failed)}/{len(report['checks'])} pass"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)


def print_validation(v: dict) -> None:
    print(f"validation: {v['cases']} cases × {v['prompts']} prompts, greedy and sampled (T={v['temperature']}), "
          f"{v['seconds']:.1f} s", flush=True)
    for k, by in v["by_kind"].items():
        print(f"  {k:<12} " + " | ".join(f"{s}: {c['stop_valid']}/{c['stop']} stop rows valid, {c['length']} length"
                                         for s, c in by.items()), flush=True)
    for row in v["invalid"]:
        print(f"  INVALID {row}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print_summary(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    print(f"total {report['seconds']:.0f} s", flush=True)
    failed = [k for k, ok in report["checks"].items() if not ok]
    assert not failed, f"structured bench checks failed: {failed}"


if __name__ == "__main__":
    main()
