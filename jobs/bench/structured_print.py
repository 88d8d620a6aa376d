"""The structured workload's printed lines (``structured.py`` writes the same figures as JSON)."""
from __future__ import annotations


def print_batch(b: int, r: dict) -> None:
    """One batch size's cells, ratios, time split and checks, printed."""
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
    """The validation section's counts per kind and its invalid rows, printed."""
    print(f"validation: {v['cases']} cases × {v['prompts']} prompts, greedy and sampled (T={v['temperature']}), "
          f"{v['seconds']:.1f} s", flush=True)
    for k, by in v["by_kind"].items():
        print(f"  {k:<12} " + " | ".join(f"{s}: {c['stop_valid']}/{c['stop']} stop rows valid, {c['length']} length"
                                         for s, c in by.items()), flush=True)
    for row in v["invalid"]:
        print(f"  INVALID {row}", flush=True)
