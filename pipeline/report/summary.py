"""Run summary: ``summary.json``, ``summary.png`` and a short printed table.

Row and speculation statistics cover the whole output directory (every run that resumed into
it); throughput covers this run only. Metric names follow DESIGN §2.2: *tokens per cycle* =
accepted drafts + 1 per cycle; *TPF* (tokens per forward pass) = tokens per cycle / 2.
"""
from __future__ import annotations

import importlib.metadata
import io
import json
import platform

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orthrus.metrics import acceptance_by_position, tokens_per_cycle
from pipeline.actor.audit import AUDIT_COLUMNS, audit_statistics
from pipeline.output.directory import SUMMARY_JSON, SUMMARY_PNG, OutputDir
from pipeline.rows.schema import key_strings

_STAT_COLUMNS = ["id", "sample_index", "finish_reason", "error", "num_prompt_tokens", "num_completion_tokens", "num_cycles",
                 "num_forward_passes", "num_draft_tokens", "num_accepted_draft_tokens", "tokens_per_cycle",
                 "accept_length_histogram", "num_tokens_after_stop", "time_waiting_s", "time_in_engine_s",
                 *AUDIT_COLUMNS]
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


def column_sum(col: pa.ChunkedArray) -> int:
    """Sum of an integer column (0 when empty or all null)."""
    return int(pc.sum(col).as_py() or 0)


def _histogram(col: pa.ChunkedArray) -> list[int]:
    """Element-wise sum of the per-row accept-length histograms (padded to the longest)."""
    rows = [h for h in col.to_pylist() if h]
    width = max((len(h) for h in rows), default=0)
    total = np.zeros(width, dtype=np.int64)
    for h in rows:
        total[: len(h)] += h
    return total.tolist()


def _duplicates(table: pa.Table) -> int:
    """Rows whose (id, sample_index) appears more than once (0 for an exactly-once output)."""
    if not table.num_rows or "sample_index" not in table.column_names:
        return 0
    keys = key_strings(table["id"], table["sample_index"])
    return table.num_rows - pc.count_distinct(keys).as_py()


def _tokens_per_cycle(ok: pa.Table) -> dict[str, float | None]:
    spec = ok.filter(pc.greater(ok["num_cycles"], 0))
    if not spec.num_rows:
        return {"mean_per_row": None, "token_weighted": None, "pooled": None, "tpf_pooled": None}
    tpc = spec["tokens_per_cycle"].to_numpy()
    weights = spec["num_completion_tokens"].to_numpy().astype(float)
    pooled = tokens_per_cycle(column_sum(spec["num_accepted_draft_tokens"]), column_sum(spec["num_cycles"]))
    return {"mean_per_row": float(tpc.mean()),
            "token_weighted": float((tpc * weights).sum() / weights.sum()) if weights.sum() else None,
            "pooled": pooled, "tpf_pooled": pooled / 2}


def _quantiles(col: pa.ChunkedArray) -> dict[str, float] | None:
    values = np.asarray([v for v in col.to_pylist() if v is not None], dtype=float)
    if not len(values):
        return None
    p50, p90, p99 = np.quantile(values, [0.5, 0.9, 0.99])
    return {"p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4),
            "max": round(float(values.max()), 4)}


def row_statistics(table: pa.Table) -> dict:
    """Counts, tokens and speculation statistics over output rows (``_STAT_COLUMNS``)."""
    ok = table.filter(pc.not_equal(table["finish_reason"], "error"))
    counts = pc.value_counts(table["finish_reason"]) if table.num_rows else None
    reasons = dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())) if counts else {}
    hist = _histogram(ok["accept_length_histogram"])
    rate, cond = acceptance_by_position(hist)
    drafts, accepted = column_sum(ok["num_draft_tokens"]), column_sum(ok["num_accepted_draft_tokens"])
    errors = table.filter(pc.equal(table["finish_reason"], "error")).slice(0, 5)
    return {
        "rows": {"total": table.num_rows, "ok": ok.num_rows, "error": table.num_rows - ok.num_rows,
                 "finish_reason": reasons, "duplicate_keys": _duplicates(table)},
        "tokens": {"prompt": column_sum(ok["num_prompt_tokens"]),
                   "completion": column_sum(ok["num_completion_tokens"]),
                   # decoded past a stop string before the row ended (at most one block per row)
                   "decoded_after_stop": (column_sum(ok["num_tokens_after_stop"])
                                          if "num_tokens_after_stop" in ok.column_names else None)},
        "speculation": {
            "cycles": column_sum(ok["num_cycles"]), "forward_passes": column_sum(ok["num_forward_passes"]),
            "draft_tokens": drafts, "accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafts if drafts else None,
            "tokens_per_cycle": _tokens_per_cycle(ok),
            "accept_length_histogram": hist,
            "acceptance_rate_by_position": rate,
            "conditional_acceptance_by_position": cond,
        },
        # per row: seconds waiting for an engine slot, and from admission to the row's end
        "row_seconds": {name: _quantiles(ok[name]) if name in ok.column_names else None
                        for name in ("time_waiting_s", "time_in_engine_s")},
        "error_examples": [{"id": i, "error": e} for i, e in zip(errors["id"].to_pylist(),
                                                                  errors["error"].to_pylist())],
    }


def summarize(out: OutputDir, run: dict, config: dict) -> dict:
    """Build the summary, write summary.json and summary.png atomically, and return it.

    ``run["complete"]`` is set here: every expected (id, sample_index) is in the output, once.
    """
    table = out.read(_STAT_COLUMNS)
    stats = row_statistics(table)
    stats["audit"] = audit_statistics(table, config.get("audit", {}).get("fraction", 0.0))
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


def render_table(summary: dict, where: str) -> str:
    """The short table printed when the job ends."""
    rows, tok, spec, run = summary["rows"], summary["tokens"], summary["speculation"], summary["run"]
    tpc = spec["tokens_per_cycle"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rows["finish_reason"].items()))
    lines = [
        f"Orthrus generation summary: {where}",
        f"  rows           {rows['total']} ({rows['ok']} ok, {rows['error']} error; {reasons})",
        f"  tokens         prompt {tok['prompt']:,}  completion {tok['completion']:,}",
        f"  this run       {run['rows_generated']} rows, {run['completion_tokens']:,} tokens in "
        f"{run['wall_seconds']:.1f} s = {_fmt(run['tokens_per_second'], '.1f')} tok/s "
        f"({run['rows_skipped_as_finished']} rows already done)",
        f"  startup        {_fmt(run.get('startup_seconds'), '.1f')} s until the first batch reached an actor, then "
        f"{_fmt(run.get('steady_tokens_per_second'), '.1f')} tok/s; slots busy "
        f"{_fmt(run.get('slot_occupancy') and 100 * run['slot_occupancy'], '.0f')}% while input lasted",
        f"  tokens/cycle   mean per row {_fmt(tpc['mean_per_row'])} | token-weighted "
        f"{_fmt(tpc['token_weighted'])} | pooled {_fmt(tpc['pooled'])} (TPF {_fmt(tpc['tpf_pooled'])})",
        f"  drafts         {spec['accepted_draft_tokens']:,}/{spec['draft_tokens']:,} accepted "
        f"({_fmt(spec['draft_acceptance_rate'] and 100 * spec['draft_acceptance_rate'], '.1f')}%)",
        "  by position    " + " ".join(f"{j}:{r:.2f}" for j, r in
                                      enumerate(spec["acceptance_rate_by_position"], start=1)),
    ]
    audit = summary.get("audit")
    if audit and audit["rows_audited"]:
        where = audit["first_divergence"]
        lines.append(f"  audit          {audit['rows_audited']} greedy rows re-decoded with plain AR: "
                     f"{audit['exact_matches']} exact, {audit['diverged']} diverged"
                     + (f" (first differing token at index {where['min']}..{where['max']}, "
                        f"median {where['median']})" if where else ""))
    cost = run.get("cost")
    if cost:
        lines.append(f"  cost           {cost['device_seconds_reserved']:.0f} {cost['device'].upper()}-seconds held "
                     f"({cost['device_seconds_busy']:.0f} busy) = {_fmt(cost['tokens_per_device_hour'], ',.0f')} "
                     f"tokens per {cost['device'].upper()}-hour")
    for a in run["actors"]:
        lines.append(f"  actor          {a['actor']} gpu_ids={a['gpu_ids']}: {a['rows']} rows, "
                     f"{_fmt(a['tokens_per_second'], '.1f')} tok/s")
    return "\n".join(lines)
