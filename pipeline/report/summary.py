"""Run summary: ``summary.json``, ``summary.png`` and a short printed table.

Row and speculation statistics cover the whole output directory (every run that resumed into
it), merged from the parts' footers (``output/stats.py``), so the summary costs the same at a
thousand rows and at a billion; throughput covers this run only. Metric names follow docs/design.md §2.4: *tokens per cycle* =
accepted drafts + 1 per cycle; *TPF* (tokens per forward pass) = tokens per cycle / 2.
"""
from __future__ import annotations

import importlib.metadata
import io
import json
import math
import platform

import pyarrow as pa
import pyarrow.compute as pc

from orthrus.metrics import acceptance_by_position, tokens_per_cycle
from pipeline.output import stats as St
from pipeline.output.prefix_ideal import ideal_computed_tokens
from pipeline.output.stats import prefix_cache_hit_rate
from pipeline.output.directory import SUMMARY_JSON, SUMMARY_PNG, OutputDir
from pipeline.report.startup import render_split
from pipeline.schema import key_strings

_PACKAGES = ("orthrus-batch", "torch", "transformers", "ray", "pyarrow", "pydantic", "numpy")


def package_versions() -> dict[str, str | None]:
    """Versions of the packages that decide the output (None when not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _prefill(prefill: dict | None) -> dict:
    """``summary.json["prefill"]``: the engines' prompt tokens computed and shared (None: unknown)."""
    prefill = prefill or {}
    computed, hits = prefill.get("computed_tokens"), prefill.get("prefix_cache_hit_tokens")
    return {"computed_tokens": computed, "prefix_cache_hit_tokens": hits,
            "prefix_cache_hit_rate": None if computed is None else prefix_cache_hit_rate(computed, hits),
            # each prompt less the whole pages it shares with its predecessor in the run's sorted
            # order: what a perfect row order computes when only whole pages are shared
            # (output/prefix_ideal.py; ~2% error). Not a lower bound: a row still running the same
            # prefix also lends its partial page, so a sorted run can compute a little less.
            "ideal_computed_tokens": ideal_computed_tokens(prefill.get("ideal"), prefill.get("kv_page_size")),
            # token positions the engines' forwards computed, padding included (EngineStats): the
            # prefill forwards' beside the prompt tokens they had to compute, and every forward's
            "token_slots": prefill.get("prefill_token_slots"),
            "forward_token_slots": prefill.get("forward_token_slots")}


def _compile_seconds(engine: dict | None) -> float | None:
    """Seconds the engines spent compiling (None: unknown, parts written before it was counted)."""
    if engine is None or engine.get("compile_ms") is None:
        return None
    return round(engine["compile_ms"] / 1000, 3)


def _kv_cache(engine: dict | None) -> dict:
    """``summary.json["kv_cache"]``: the engines' page pool (None: unknown, e.g. parts written before paging)."""
    keys = ("page_size", "pages", "pages_in_use_mean", "pages_in_use_peak", "rows_in_flight_mean", "preemptions",
            "recomputed_tokens")
    if engine is None or engine.get("kv_pages") is None:
        return dict.fromkeys(keys)
    iterations = engine.get("iterations") or 0
    mean = (lambda n: round(n / iterations, 2) if iterations else None)   # noqa: E731
    return dict(zip(keys, (engine["kv_page_size"], engine["kv_pages"], mean(engine.get("page_iterations", 0)),
                           engine["kv_pages_peak"], mean(engine.get("busy_slot_iterations", 0)),
                           engine.get("preemptions", 0), engine.get("recomputed_tokens", 0))))


def statistics(total: dict, duplicates: int, audit_fraction: float) -> dict:
    """Counts, tokens, speculation, row times, errors and the audit, from merged part aggregates
    (``output/stats.py``): the summary never reads a row."""
    sums, spec = total["sums"], total["speculation"]
    ok = total["rows"] - total["error"]
    return {
        "rows": {"total": total["rows"], "ok": ok, "error": total["error"],
                 "finish_reason": total["finish_reason"], "duplicate_keys": duplicates},
        # every summed column of the table (``columns.py``) over the ok rows; 0 for a column
        # older parts lack
        "column_sums": {name: sums.get(name, 0) for name in St.SUMS},
        "tokens": {"prompt": sums["num_prompt_tokens"], "completion": sums["num_completion_tokens"],
                   # decoded past a stop string before the row ended (at most one block per row)
                   "decoded_after_stop": sums["num_tokens_after_stop"] if total["after_stop_known"] else None,
                   # reasoning rows' thinking (up to and including the think end) and the rest
                   "reasoning": sums.get("num_reasoning_tokens", 0),
                   "answer": sums["num_completion_tokens"] - sums.get("num_reasoning_tokens", 0)},
        # prompt tokens the generation engines prefilled and shared from pages or slots holding them (the
        # prefix cache), summed over the batches committed in data/ (engine work: retries included)
        "prefill": _prefill(total.get("prefill")),
        # the paged KV cache per engine: pages held (mean over iterations, peak), rows in flight, preemptions
        "kv_cache": _kv_cache(total.get("prefill")),
        # time the engines spent compiling their layer pieces (engine.compile), summed over the
        # batches committed in data/ (every replica compiles its own; a warm disk cache loads instead)
        "engine": {"compile_seconds": _compile_seconds(total.get("prefill"))},
        "speculation": _speculation(sums, spec, ok, total["histogram"]),
        # per row: seconds waiting for an engine slot, and from admission to the row's end
        "row_seconds": {name: St.quantiles(total["times"].get(name)) for name in St.TIME_COLUMNS},
        "error_examples": total["error_examples"],
        "audit": _audit(total["audit"], audit_fraction),
    }


def _speculation(sums: dict, spec: dict, ok: int, hist: list) -> dict:
    """``summary.json["speculation"]``: cycles, drafts and what was accepted of them, tokens per cycle."""
    rate, cond = acceptance_by_position(hist)
    drafts, accepted = sums["num_draft_tokens"], sums["num_accepted_draft_tokens"]
    pooled = tokens_per_cycle(accepted, sums["num_cycles"]) if spec["spec_rows"] else None
    return {
        # rows whose only token came from their prefill (max_new_tokens 1, or EOS at once): no cycle
        "rows_ended_at_prefill": ok - spec["spec_rows"],
        "cycles": sums["num_cycles"], "forward_passes": sums["num_forward_passes"],
        "draft_tokens": drafts, "accepted_draft_tokens": accepted,
        # drafts the verifier computed (a cycle's verify budget skips the ones unlikely to pass)
        # and how many it computed per accepted one: the verify pass's waste
        "verified_draft_tokens": sums.get("num_verified_draft_tokens", 0),
        "verified_per_accepted": sums.get("num_verified_draft_tokens", 0) / accepted if accepted else None,
        "draft_acceptance_rate": accepted / drafts if drafts else None,
        "tokens_per_cycle": {
            "mean_per_row": spec["tpc_sum"] / spec["spec_rows"] if spec["spec_rows"] else None,
            "token_weighted": spec["tpc_weighted_sum"] / spec["tpc_weight"] if spec["tpc_weight"] else None,
            "pooled": pooled, "tpf_pooled": pooled / 2 if pooled is not None else None,
            **_by_phase(sums)},
        "accept_length_histogram": hist,
        "acceptance_rate_by_position": rate,
        "conditional_acceptance_by_position": cond,
    }


def _audit(audit: dict, fraction: float) -> dict:
    where = sorted((int(k), c) for k, c in audit["divergence_at"].items())
    flat_count = sum(c for _, c in where)
    median = None
    if flat_count:
        seen = 0
        for k, c in where:      # the element at index count // 2 of the sorted divergences
            seen += c
            if seen > flat_count // 2:
                median = k
                break
    return {"fraction": fraction, "rows_audited": audit["audited"], "exact_matches": audit["audited"] - audit["diverged"],
            "diverged": audit["diverged"],
            "first_divergence": {"min": where[0][0], "median": median, "max": where[-1][0]} if where else None,
            "diverged_examples": audit["diverged_examples"]}


def row_statistics(table: pa.Table) -> dict:
    """The summary's statistics over some output rows (duplicates counted by key within them)."""
    dups = 0
    if table.num_rows and "sample_index" in table.column_names:
        dups = table.num_rows - pc.count_distinct(key_strings(table["id"], table["sample_index"])).as_py()
    return statistics(St.of_table(table), dups, 0.0)


def summarize(out: OutputDir, run: dict, config: dict) -> dict:
    """Build the summary from the parts' footers, write summary.json and summary.png atomically,
    and return it. ``run["complete"]`` is set here: every expected (id, sample_index) is in the
    output, once."""
    done, total, _ = out.done()
    _, duplicates = done.merged()
    stats = statistics(total, duplicates, config.get("audit", {}).get("fraction", 0.0))
    rows = stats["rows"]
    run = {**run, "rows_in_output": rows["total"],
           "complete": rows["total"] == run.get("rows_expected") and not rows["duplicate_keys"]}
    summary = {**stats, "run": run, "config": config, "versions": package_versions()}
    out.write_atomic(SUMMARY_JSON, json.dumps(summary, indent=2).encode())
    out.write_atomic(SUMMARY_PNG, plot_png(summary))
    return summary


def plot_png(summary: dict) -> bytes:
    """Accept-length histogram and per-position acceptance, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    spec = summary["speculation"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    hist = spec["accept_length_histogram"]
    left.bar(range(len(hist)), hist, color="tab:blue")
    left.set(title="Accepted drafts per cycle", xlabel="accepted drafts L", ylabel="cycles")
    rate = spec["acceptance_rate_by_position"]
    right.plot(range(1, len(rate) + 1), rate, marker="o", label="P(draft j accepted)")
    right.plot(range(1, len(rate) + 1), spec["conditional_acceptance_by_position"], marker=".",
               linestyle="--", label="P(j accepted | j-1 accepted)")
    right.set(title="Acceptance by draft position", xlabel="draft position j", ylim=(0, 1.05))
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    tpc = spec["tokens_per_cycle"]["pooled"]
    fig.suptitle(f"{summary['rows']['total']} rows; tokens per cycle (pooled) = "
                 f"{tpc:.2f}" if tpc else f"{summary['rows']['total']} rows")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _sig3(x: float | None) -> str:
    """Three significant digits without an exponent (76.0, 0.500, 0.0123, 1,234): the cost per
    billion tokens spans orders of magnitude between a CPU and a GPU run."""
    if not x:
        return _fmt(x)
    return format(x, f",.{max(0, 2 - math.floor(math.log10(abs(x))))}f")


def _kv_line(kv: dict | None) -> list[str]:
    if not kv or kv.get("pages") is None:
        return []
    return [f"  kv cache       {_fmt(kv['pages_in_use_mean'], ',.0f')} pages held on average, peak "
            f"{kv['pages_in_use_peak']:,} of {kv['pages']:,} ({kv['page_size']} tokens each); "
            f"{_fmt(kv['rows_in_flight_mean'], '.1f')} rows in flight; {kv['preemptions']:,} preemptions "
            f"({kv['recomputed_tokens']:,} tokens recomputed)"]


def _prefill_line(prefill: dict | None) -> list[str]:
    if not prefill or prefill["computed_tokens"] is None:
        return []
    ideal = prefill.get("ideal_computed_tokens")
    return [f"  prefill        {prefill['computed_tokens']:,} prompt tokens computed, "
            f"{prefill['prefix_cache_hit_tokens']:,} shared by the prefix cache "
            f"({_fmt(prefill['prefix_cache_hit_rate'] and 100 * prefill['prefix_cache_hit_rate'], '.0f')}% hits)"
            + ("" if ideal is None else f"; {ideal:,} in the ideal order")
            + ("" if not prefill.get("forward_token_slots") else
               f"; forwards computed {prefill['forward_token_slots']:,} token slots "
               f"({prefill['token_slots']:,} in prefills)")]


def _slots(run: dict, spec: dict) -> str:
    """Slot occupancy, or why there is none: rows that end at their prefill never decode, so no
    decode iteration counts slots (a labelling job at max_new_tokens 1)."""
    if run.get("slot_occupancy") is None and spec.get("rows_ended_at_prefill") and not spec.get("cycles"):
        return "no decode iterations (every row ended at its prefill)"
    return f"slots busy {_fmt(run.get('slot_occupancy') and 100 * run['slot_occupancy'], '.0f')}% while input lasted"


def _cycles_line(tpc: dict, at_prefill: int) -> str:
    if tpc["pooled"] is None and at_prefill:
        return f"  tokens/cycle   none: all {at_prefill:,} rows ended at their prefill, before any cycle"
    return (f"  tokens/cycle   mean per row {_fmt(tpc['mean_per_row'])} | token-weighted "
            f"{_fmt(tpc['token_weighted'])} | pooled {_fmt(tpc['pooled'])} (TPF {_fmt(tpc['tpf_pooled'])})"
            + (f"; {at_prefill:,} rows ended at their prefill" if at_prefill else ""))


def render_table(summary: dict, where: str) -> str:
    """The short table printed when the job ends."""
    rows, tok, spec, run = summary["rows"], summary["tokens"], summary["speculation"], summary["run"]
    tpc = spec["tokens_per_cycle"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rows["finish_reason"].items()))
    lines = [
        f"Orthrus generation summary: {where}",
        f"  rows           {rows['total']} ({rows['ok']} ok, {rows['error']} error; {reasons})",
        f"  tokens         prompt {tok['prompt']:,}  completion {tok['completion']:,}",
        *_prefill_line(summary.get("prefill")),
        *_kv_line(summary.get("kv_cache")),
        f"  this run       {run['rows_generated']} rows, {run['completion_tokens']:,} tokens in "
        f"{run['wall_seconds']:.1f} s = {_fmt(run['tokens_per_second'], '.1f')} tok/s "
        f"({run['rows_skipped_as_finished']} rows already done)",
        f"  startup        {_fmt(run.get('startup_seconds'), '.1f')} s from the run's start (Ray up) to the first batch at an actor, then "
        f"{_fmt(run.get('steady_tokens_per_second'), '.1f')} tok/s = {_fmt(run.get('steady_rows_per_second'), '.1f')} "
        f"rows/s; {_slots(run, spec)}",
        *render_split(run.get("startup")),
        _cycles_line(tpc, spec.get("rows_ended_at_prefill") or 0),
    ]
    if spec["draft_tokens"]:     # none when every row ended at its prefill (or decoded in AR mode)
        lines += [f"  drafts         {spec['accepted_draft_tokens']:,}/{spec['draft_tokens']:,} accepted "
                  f"({_fmt(spec['draft_acceptance_rate'] and 100 * spec['draft_acceptance_rate'], '.1f')}%), "
                  f"{spec.get('verified_draft_tokens', 0):,} verified "
                  f"({_fmt(spec.get('verified_per_accepted'), '.2f')} per accepted)",
                  "  by position    " + " ".join(f"{j}:{r:.2f}" for j, r in
                                                enumerate(spec["acceptance_rate_by_position"], start=1))]
    audit = summary.get("audit")
    if audit and audit["rows_audited"]:
        where = audit["first_divergence"]
        lines.append(f"  audit          {audit['rows_audited']} greedy rows re-decoded with plain AR: "
                     f"{audit['exact_matches']} exact, {audit['diverged']} diverged"
                     + (f" (first differing token at index {where['min']}..{where['max']}, "
                        f"median {where['median']})" if where else ""))
    cost = run.get("cost")
    if cost:
        device = cost["device"].upper()
        lines.append(f"  cost           {cost['device_seconds_reserved']:.0f} {device}-seconds held "
                     f"({cost['device_seconds_busy']:.0f} busy) = {_fmt(cost['tokens_per_device_hour'], ',.0f')} "
                     f"tokens per {device}-hour = {_sig3(cost.get('device_days_per_billion_output_tokens'))} "
                     f"{device}-days per billion output tokens")
    for a in run["actors"]:
        lines.append(f"  actor          {a['actor']} gpu_ids={a['gpu_ids']}: {a['rows']} rows, "
                     f"{_fmt(a['tokens_per_second'], '.1f')} tok/s")
    return "\n".join(lines)


def _by_phase(sums: dict) -> dict:
    """Pooled tokens per cycle of the iterations begun while reasoning rows thought, and of all the
    others (how well the drafter does on thinking vs answers); nothing without reasoning rows."""
    cycles_r = sums.get("num_reasoning_cycles", 0)
    if not cycles_r:
        return {}
    accepted_r = sums.get("num_reasoning_accepted_draft_tokens", 0)
    rest = sums["num_cycles"] - cycles_r
    return {"reasoning_pooled": tokens_per_cycle(accepted_r, cycles_r),
            "answer_pooled": tokens_per_cycle(sums["num_accepted_draft_tokens"] - accepted_r, rest) if rest > 0 else None}
