"""Prefix grouping: what ordering rows by prompt token ids saves when many templates share the run.

    python -m jobs.bench prefix_grouping              # writes bench-results/prefix_grouping.json
    python -m jobs.bench prefix_grouping --no-job     # the engine arms only

The workload (``grouping_workload``): ``P`` templates of ~``--template-tokens`` tokens of held-out
text (whole lines of ``examples/shards``' functions, each template starting at its own line), ``--rows``
rows spread evenly over them (N/P each), every row its template then its own 20–80-token tail (a
window of the held-out text), tokenized as one text, shuffled with a fixed seed. For each P in
``--templates`` four arms run through the bare engine (``--slots`` slots, ``--max-new-tokens`` new
tokens, greedy, float32, a fresh engine per run so every run starts with an empty cache):

- ``unsorted``: the shuffled order;
- ``window``: each consecutive window of ``--window`` rows ordered with ``prompt_order`` (what the
  job does with ``engine.prefix_grouping``; W < N, so it differs from the global order);
- ``global``: all N rows ordered with ``prompt_order`` (a global sort: the ideal order);
- ``cache_off``: the shuffled order with ``prefix_cache=False``.

Reported per arm: prompt tokens computed (``EngineStats.prefill_tokens``) and shared
(``prefix_cache_hit_tokens``) against ``exact_ideal(prompts, 16)`` and rows/s. Completions must be
token-identical across all arms (the run raises otherwise). Also the sort's own cost: ``prompt_order``
on a 1,024-row window of these prompts.

The job (skipped with ``--no-job``): P = ``--job-templates`` rows as text through the Ray Data job
(embedded local Ray), ``engine.prefix_grouping`` false vs true (default window), ``--job-reps``
interleaved runs each: medians of steady tokens/s, time to the first batch (``startup_seconds``),
computed tokens vs ``prefill.ideal_computed_tokens``; completions compared by id across every run.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from jobs.bench import common
from jobs.bench.prefix import held_out
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline.output.prefix_ideal import exact_ideal
from pipeline.requests.grouping import prompt_order

PAGE = 16                       # the engine's KV page on CPU (SDPA): the unit the prefix cache shares
ARMS = ("unsorted", "window", "global", "cache_off")


@dataclass(frozen=True)
class GroupingWorkload:
    """Rows over ``len(templates)`` templates, in the shuffled (input) order."""

    templates: list[str]
    texts: list[str]             # row i: its template's text + its own tail
    prompts: list[list[int]]     # row i's tokens (the text tokenized as one)
    template_of: list[int]       # row i's template
    template_tokens: list[int]   # each template's length in tokens, alone


def held_out_text(prompts_dir: str) -> tuple[list[str], str]:
    """(the held-out functions' non-blank lines, in id order; all their text as one string)."""
    text = "".join(r["prompt"] + r["reference"] + "\n" for r in held_out(prompts_dir))
    return [line + "\n" for line in text.split("\n") if line.strip()], text


def make_templates(tok, lines: list[str], count: int, target: int) -> list[str]:
    """``count`` templates of about ``target`` tokens: whole lines from evenly spaced starting lines
    (wrapping around), so they overlap in text but no two start alike (no shared first page)."""
    sizes = [len(ids) for ids in tok(lines, add_special_tokens=False)["input_ids"]]
    out = []
    for j in range(count):
        i, text, total = j * len(lines) // count, "", 0
        while total + sizes[i % len(lines)] <= target:
            text, total, i = text + lines[i % len(lines)], total + sizes[i % len(lines)], i + 1
        out.append(text)
    return out


def make_tails(tok, text: str, n: int, lo: int, hi: int, rnd: random.Random) -> list[str]:
    """``n`` tails: windows of ``lo``–``hi`` tokens at random offsets of the held-out text (leading
    newlines dropped, so a tail does not merge with its template's final newline)."""
    stream = tok(text, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(n):
        length = rnd.randint(lo, hi)
        start = rnd.randrange(len(stream) - length)
        out.append(tok.decode(stream[start: start + length]).lstrip("\n") or "pass")
    return out


def grouping_workload(tok, prompts_dir: str, templates: int, rows: int, template_tokens: int = 500,
                      tail_range: tuple[int, int] = (20, 80), seed: int = 0) -> GroupingWorkload:
    """``rows`` rows over ``templates`` templates (row i before the shuffle: template i mod P), shuffled."""
    lines, text = held_out_text(prompts_dir)
    temps = make_templates(tok, lines, templates, template_tokens)
    rnd = random.Random(seed)
    tails = make_tails(tok, text, rows, *tail_range, rnd)
    order = list(range(rows))
    rnd.shuffle(order)
    of = [i % templates for i in order]
    texts = [temps[j] + tails[i] for j, i in zip(of, order)]
    sizes = [len(ids) for ids in tok(temps, add_special_tokens=False)["input_ids"]]
    return GroupingWorkload(temps, texts, tok(texts, add_special_tokens=False)["input_ids"], of, sizes)


def as_list_array(prompts: list[list[int]]) -> pa.ListArray:
    """Prompts as the job carries them (``list<int32>``), for ``prompt_order``."""
    return pa.array(prompts, pa.list_(pa.int32()))


def window_order(prompts: list[list[int]], window: int) -> list[int]:
    """Each consecutive ``window`` rows ordered by ``prompt_order``, windows kept in input order."""
    out: list[int] = []
    for lo in range(0, len(prompts), window):
        out += (lo + prompt_order(as_list_array(prompts[lo: lo + window]))).tolist()
    return out


def arm_orders(prompts: list[list[int]], window: int) -> dict[str, tuple[list[int], bool]]:
    """Each arm's row order (a permutation of the input rows) and whether its engine caches prefixes."""
    shuffled = list(range(len(prompts)))
    return {"unsorted": (shuffled, True), "window": (window_order(prompts, window), True),
            "global": (prompt_order(as_list_array(prompts)).tolist(), True), "cache_off": (shuffled, False)}


def run_arm(model: OrthrusForCausalLM, prompts: list[list[int]], order: list[int], cache: bool, slots: int,
            max_new: int, speculative: bool | str) -> dict:
    """One arm on a fresh engine (an empty prefix cache) → seconds, rows/s, prompt tokens computed
    and shared, and the completions' token ids in input order."""
    engine = OrthrusEngine(model, max_batch_size=slots, max_seq_len=max(map(len, prompts)) + max_new + 1,
                           static_shapes=False, speculative=speculative, prefix_cache=cache)
    seconds, outs = common.time_generate(engine, [prompts[i] for i in order], SamplingParams(max_new_tokens=max_new))
    ids: list = [None] * len(prompts)
    for i, out in zip(order, outs):
        ids[i] = out.token_ids
    return {"seconds": seconds, "rows_per_s": len(prompts) / seconds, "computed_tokens": engine.stats.prefill_tokens,
            "hit_tokens": engine.stats.prefix_cache_hit_tokens, "ids": ids}


def engine_arms(model: OrthrusForCausalLM, w: GroupingWorkload, window: int, slots: int, max_new: int,
                reps: int, speculative: bool | str) -> dict:
    """The four arms at one P, ``reps`` interleaved rounds (rotating order) → one report cell.
    Raises if any two runs' completions differ."""
    orders = arm_orders(w.prompts, window)
    runs = {name: (lambda o=o, c=c: run_arm(model, w.prompts, o, c, slots, max_new, speculative))
            for name, (o, c) in orders.items()}
    r = common.rounds(runs, reps, warmup=False)
    every = [ids for name in ARMS for ids in r.ids[name]]
    if any(ids != every[0] for ids in every):
        bad = [name for name in ARMS if any(ids != every[0] for ids in r.ids[name])]
        raise RuntimeError(f"P={len(w.templates)}: completions differ from the unsorted arm's in {bad}")
    ideal, total = exact_ideal(w.prompts, PAGE), sum(map(len, w.prompts))
    cell = {"templates": len(w.templates), "rows": len(w.prompts), "prompt_tokens": total,
            "ideal_computed_tokens": ideal, "completions_identical": True, "arms": {}}
    for name in ARMS:
        cells = r.samples[name]
        computed = cells[0]["computed_tokens"]          # deterministic: the same order gives the same pages
        cell["arms"][name] = {"computed_tokens": computed, "hit_tokens": cells[0]["hit_tokens"],
                              "computed_over_ideal": computed / ideal,
                              "rows_per_s": common.med(cells, "rows_per_s"), "seconds": common.med(cells, "seconds")}
    base = cell["arms"]["unsorted"]["rows_per_s"]
    for name in ARMS:
        cell["arms"][name]["rows_per_s_over_unsorted"] = cell["arms"][name]["rows_per_s"] / base
    return cell


def sort_cost(prompts: list[list[int]], rows: int = 1024, reps: int = 9) -> dict:
    """``prompt_order`` on the first ``rows`` prompts (one window): median seconds of ``reps`` calls."""
    window = as_list_array(prompts[:rows])
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        prompt_order(window)
        seconds.append(time.perf_counter() - start)
    med = statistics.median(seconds)
    return {"rows": len(window), "prompt_tokens": sum(map(len, prompts[:rows])), "reps": reps,
            "median_ms": 1e3 * med, "us_per_row": 1e6 * med / len(window)}


def template_intact(tok, w: GroupingWorkload) -> float:
    """The share of rows whose prompt starts with their template's tokens (the tail did not change
    how the template tokenizes), so the rows of a template really share its pages."""
    heads = tok(w.templates, add_special_tokens=False)["input_ids"]
    return statistics.mean(p[: len(heads[j])] == heads[j] for p, j in zip(w.prompts, w.template_of))


def job_run(config: str, sets: list[str], out: Path) -> dict:
    """One job run → its figures from ``summary.json`` and its completions by id."""
    import pyarrow.dataset as pads

    from jobs.bench.job import run_job
    summary = run_job(config, sets, out)
    run, prefill = summary["run"], summary.get("prefill") or {}
    table = pads.dataset(out / "data", format="parquet").to_table(columns=["id", "completion"]).to_pydict()
    return {"steady_tokens_per_s": run["steady_tokens_per_second"], "startup_s": run["startup_seconds"],
            "wall_s": run["wall_seconds"], "rows": run["rows_generated"],
            "computed_tokens": prefill.get("computed_tokens"), "hit_tokens": prefill.get("prefix_cache_hit_tokens"),
            "ideal_computed_tokens": prefill.get("ideal_computed_tokens"),
            "ids": dict(zip(table["id"], table["completion"]))}


def job_arms(model_path: str, w: GroupingWorkload, config: str, slots: int, max_new: int, reps: int,
             speculative: bool | str, window: int | None) -> dict:
    """The workload as text through the Ray Data job, ``engine.prefix_grouping`` false vs true,
    ``reps`` interleaved runs each (rotating order) → medians, ratio, prefill vs ideal, identity."""
    import tempfile

    import pyarrow.parquet as pq
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-grouping-"))
    (tmp / "in").mkdir()
    pq.write_table(pa.table({"id": [f"g{i:05d}" for i in range(len(w.texts))], "prompt": w.texts}),
                   tmp / "in" / "rows.parquet")
    # the engine arms' sizes: the same KV pool (slots x the longest row), no audit engine beside it
    sets = ["prompt.chat_template=off", "sampling.stop=[]", "sampling.temperature=0", "audit.fraction=0",
            f"sampling.max_new_tokens={max_new}", f"engine.speculative={json.dumps(speculative)}",
            f"engine.max_batch_size={slots}", f"engine.max_seq_len={max(map(len, w.prompts)) + max_new + 1}",
            f"input.paths=[{tmp / 'in'}]", f"model.path={model_path}"]
    if window is not None:
        sets.append(f"engine.prefix_grouping_rows={window}")
    count = iter(range(10 ** 6))
    runs = {name: (lambda on=on, name=name: job_run(config, sets + [f"engine.prefix_grouping={on}"],
                                                    tmp / f"{name}-{next(count)}"))
            for name, on in (("grouping_off", "false"), ("grouping_on", "true"))}
    r = common.rounds(runs, reps, warmup=False)
    every = [ids for runs_ids in r.ids.values() for ids in runs_ids]
    report: dict = {"templates": len(w.templates), "rows": len(w.texts), "slots": slots, "reps": reps,
                    "window": window or "default: max(1024, batch rows)",
                    "exact_ideal_computed_tokens": exact_ideal(w.prompts, PAGE),
                    "completions_identical": all(ids == every[0] for ids in every)}
    for name, cells in r.samples.items():
        report[name] = {key: common.med(cells, key) for key in ("steady_tokens_per_s", "startup_s", "wall_s")}
        report[name].update({key: cells[0][key] for key in ("rows", "computed_tokens", "hit_tokens",
                                                            "ideal_computed_tokens")})
        report[name]["computed_tokens_all_runs"] = [c["computed_tokens"] for c in cells]
        report[name]["steady_tokens_per_s_all_runs"] = [c["steady_tokens_per_s"] for c in cells]
    on, off = report["grouping_on"], report["grouping_off"]
    report["steady_on_over_off"] = on["steady_tokens_per_s"] / off["steady_tokens_per_s"]
    report["median_of_pair_ratios"] = common.pair_ratio(r.samples["grouping_on"], r.samples["grouping_off"],
                                                        "steady_tokens_per_s")
    return report


def add_args(ap) -> None:
    """The prefix_grouping workload's own arguments (16 new tokens, one round, one thread by default)."""
    ap.add_argument("--templates", default="1,8,32,128,512", help="comma list of P (templates)")
    ap.add_argument("--rows", type=int, default=512, help="N: rows per P, N/P per template")
    ap.add_argument("--window", type=int, default=128, help="W: rows ordered together in the window arm (< N)")
    ap.add_argument("--template-tokens", type=int, default=500)
    ap.add_argument("--tail-tokens", default="20,80", help="min,max tokens of each row's own tail")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="tails and the shuffle")
    ap.add_argument("--speculative", default="false", choices=["true", "false", "auto"],
                    help="decode mode (prefill, what this measures, is the same in every mode)")
    ap.add_argument("--sort-rows", type=int, default=1024, help="rows in the window prompt_order is timed on")
    ap.add_argument("--job-templates", type=int, default=32, help="P of the job part")
    ap.add_argument("--job-reps", type=int, default=3)
    ap.add_argument("--job-window", type=int, default=None, help="engine.prefix_grouping_rows (default: the job's)")
    ap.set_defaults(reps=1, threads=1, max_new_tokens=16)


def run(args: argparse.Namespace) -> dict:
    """The engine arms per P, the sort's cost, and the job part → the report (printed as it goes)."""
    from transformers import AutoTokenizer
    common.set_threads(args)
    if args.window >= args.rows:
        raise SystemExit(f"--window {args.window} must be below --rows {args.rows} (else it is the global order)")
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = common.load_model(args.model)
    spec = {"true": True, "false": False, "auto": "auto"}[args.speculative]
    tails = tuple(int(x) for x in args.tail_tokens.split(","))
    build = lambda p, n: grouping_workload(tok, args.prompts, p, n, args.template_tokens, tails, args.seed)  # noqa
    run_arm(model, [[1, 2, 3]] * 4, list(range(4)), True, 2, 2, spec)     # torch's first-call costs, untimed
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "rows": args.rows, "window": args.window,
                    "slots": args.slots, "max_new_tokens": args.max_new_tokens, "speculative": spec,
                    "reps": args.reps, "page": PAGE, "by_templates": {}}
    for p in (int(x) for x in args.templates.split(",")):
        w = build(p, args.rows)
        cell = engine_arms(model, w, args.window, args.slots, args.max_new_tokens, args.reps, spec)
        cell["template_tokens_mean"] = statistics.mean(w.template_tokens)
        cell["row_tokens_mean"] = statistics.mean(map(len, w.prompts))
        cell["template_prefix_intact"] = template_intact(tok, w)
        report["by_templates"][str(p)] = cell
        print_cell(cell)
    report["sort_cost"] = sort_cost(build(args.job_templates, args.sort_rows).prompts, args.sort_rows)
    print(f"prompt_order on a {report['sort_cost']['rows']}-row window: {report['sort_cost']['median_ms']:.2f} ms "
          f"({report['sort_cost']['us_per_row']:.2f} µs per row)", flush=True)
    if args.job:
        w = build(args.job_templates, args.rows)
        report["job"] = job_arms(args.model, w, args.job_config, args.slots, args.max_new_tokens, args.job_reps,
                                 spec, args.job_window)
        print_job(report["job"])
    report["seconds"] = time.perf_counter() - start
    return report


def print_cell(c: dict) -> None:
    """One P's printed line."""
    arms = "; ".join(f"{name} {a['computed_tokens']:,} (×{a['computed_over_ideal']:.2f}) {a['rows_per_s']:.1f} rows/s"
                     for name, a in c["arms"].items())
    print(f"P={c['templates']}: ideal {c['ideal_computed_tokens']:,} of {c['prompt_tokens']:,} prompt tokens; "
          f"computed: {arms}; completions identical", flush=True)


def print_job(j: dict) -> None:
    """The job part's printed line."""
    on, off = j["grouping_on"], j["grouping_off"]
    print(f"job, P={j['templates']}: grouping on {on['steady_tokens_per_s']:.0f} steady tok/s "
          f"(computed {on['computed_tokens']:,}), off {off['steady_tokens_per_s']:.0f} (computed "
          f"{off['computed_tokens']:,}), ×{j['steady_on_over_off']:.2f}; ideal {on['ideal_computed_tokens']} "
          f"(exact {j['exact_ideal_computed_tokens']:,}); startup {on['startup_s']:.1f} / {off['startup_s']:.1f} s; "
          f"completions identical: {j['completions_identical']}", flush=True)


def main(args: argparse.Namespace) -> None:
    """The engine arms, sort cost and job → ``bench-results/prefix_grouping.json``; a job whose
    completions differ between its runs raises after the report is written."""
    report = run(args)
    common.write_report(args, report)
    print(f"total {report['seconds']:.0f} s", flush=True)
    assert report.get("job", {}).get("completions_identical", True), "job completions differ between runs"
