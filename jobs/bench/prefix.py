"""Prefix cache and short outputs: what the engine saves on shared prompt prefixes, and what a
speculative engine costs on rows that end after one or a few tokens.

    python -m jobs.bench prefix                 # writes bench-results/prefix.json
    python -m jobs.bench prefix --no-job        # the same without the Ray job part
    python -m jobs.bench prefix --sections short --out short.json

Sections (``--sections``; the bundled model in float32, greedy, ``--threads`` torch threads):

- ``prefix`` (the engine): ``--rows`` held-out rows, each a ~``--prefix-tokens`` shared prefix
  (an instruction and whole held-out examples: a function's signature, docstring and body) then a
  row-specific part of 20–80 tokens (another held-out function's signature and docstring, cut or
  extended to that range), tokenized as one text; ``--max-new-tokens`` new tokens through
  ``--slots`` slots. One engine with ``prefix_cache=True`` and one with ``False`` run interleaved
  repetitions (the first a warm-up); reported: rows/s with the cache ÷ without (target >= 2.0),
  prompt tokens computed per row once the prefix is cached (``engine.stats.prefill_tokens`` delta ÷
  rows on a warm engine) ÷ the mean row-specific length (target <= 1.2), and whether every
  completion is token-identical between the two (it must be).
- ``prefix`` (the job, skipped with ``--no-job``): the same rows as text through the Ray Data job
  (embedded local Ray, ``--job-config`` with the bench's overrides), ``engine.prefix_cache`` true vs
  false: steady tokens/s from ``summary.json`` and its ratio, completions compared by id.
- ``short``: ``--short-rows`` distinct ``--short-prompt-tokens``-token held-out prompts through
  ``--short-slots`` slots with ``max_new_tokens`` in ``--short-max-new``: speculative rows/s ÷ AR-mode
  rows/s (target >= 0.9), interleaved repetitions, medians; tokens checked identical.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as pads
import torch

from jobs.bench import common
from jobs.bench.common import med, pair_ratio
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams

INSTRUCTION = ("# Complete the body of the last function below. It follows the conventions of the\n"
               "# Python standard library; the complete functions before it are examples.\n\n")


@dataclass(frozen=True)
class PrefixWorkload:
    """Rows sharing one leading text: ``prompts[i]`` = tokens of ``prefix_text + row_texts[i]``."""

    prefix_text: str
    row_texts: list[str]
    prompts: list[list[int]]
    shared_tokens: int           # tokens of the prefix text alone (every prompt starts with them)
    examples: list[str]          # ids of the held-out rows whose functions make up the prefix

    @property
    def row_tokens(self) -> list[int]:
        """Each prompt's own tokens (after the shared prefix)."""
        return [len(p) - self.shared_tokens for p in self.prompts]


def held_out(prompts_dir: str) -> list[dict]:
    """The held-out rows (``id``, ``prompt``: signature + docstring, ``reference``: the body), by id."""
    cols = ["id", "prompt", "reference"]
    return sorted(pads.dataset(prompts_dir, format="parquet").to_table(columns=cols).to_pylist(),
                  key=lambda r: r["id"])


def build_prefix(tok, rows: list[dict], target: int) -> tuple[str, list[int]]:
    """The instruction and whole held-out functions (largest first, each added if the text stays
    within ``target`` tokens) → (the prefix text, indices of the rows it used)."""
    sizes = [len(tok(r["prompt"] + r["reference"] + "\n")["input_ids"]) for r in rows]
    text, used, total = INSTRUCTION, [], len(tok(INSTRUCTION)["input_ids"])
    for i in sorted(range(len(rows)), key=lambda i: (-sizes[i], rows[i]["id"])):
        if total + sizes[i] <= target:
            text, total = text + rows[i]["prompt"] + rows[i]["reference"] + "\n", total + sizes[i]
            used.append(i)
        if total >= 0.97 * target:
            break
    return text, used


def row_text(tok, row: dict, lo: int, hi: int) -> str:
    """A row's own part: its signature + docstring, cut to ``hi`` tokens or extended into its body
    up to ``lo`` tokens."""
    n = min(max(len(tok(row["prompt"])["input_ids"]), lo), hi)
    return tok.decode(tok(row["prompt"] + row["reference"])["input_ids"][:n])


def prefix_workload(tok, prompts_dir: str, rows: int = 256, prefix_tokens: int = 1000,
                    row_range: tuple[int, int] = (20, 80)) -> PrefixWorkload:
    """``rows`` distinct held-out rows behind one ~``prefix_tokens`` prefix (examples disjoint from rows)."""
    data = held_out(prompts_dir)
    prefix, used = build_prefix(tok, data, prefix_tokens)
    taken = set(used)
    rest = [r for i, r in enumerate(data) if i not in taken]
    if rows > len(rest):
        raise ValueError(f"{rows} rows asked for; the held-out set has {len(rest)} besides the prefix's examples")
    texts = [row_text(tok, r, *row_range) for r in rest[:rows]]
    prompts, head = [tok(prefix + t)["input_ids"] for t in texts], tok(prefix)["input_ids"]
    if any(p[: len(head)] != head for p in prompts):
        raise ValueError("the prefix's tokens changed where a row's text joined it (end the prefix on a newline)")
    return PrefixWorkload(prefix, texts, prompts, len(head), [data[i]["id"] for i in used])


def timed_generate(engine: OrthrusEngine, prompts: list[list[int]], max_new: int,
                   speculative: bool | str | None = None) -> dict:
    """One greedy ``generate`` → seconds, rows/s, tokens/s, prompt tokens computed and copied, the ids."""
    p0, h0 = engine.stats.prefill_tokens, engine.stats.prefix_cache_hit_tokens
    seconds, outs = common.time_generate(engine, prompts, SamplingParams(max_new_tokens=max_new), speculative)
    return {"seconds": seconds, "rows_per_s": len(prompts) / seconds,
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
            "prefill_tokens": engine.stats.prefill_tokens - p0,
            "hit_tokens": engine.stats.prefix_cache_hit_tokens - h0, "ids": [o.token_ids for o in outs]}


def interleaved(runs: dict, reps: int) -> tuple[dict[str, list[dict]], dict[str, dict], bool]:
    """``reps`` + 1 rounds of every ``runs[name]()`` in rotating order (round 0: warm-up) →
    (the timed samples by name, round 0's by name, whether every run gave the same token ids)."""
    r = common.rounds(runs, reps)
    every = [ids for runs_ids in r.ids.values() for ids in runs_ids]
    return r.samples, r.first, all(ids == every[0] for ids in every)


def engine_prefix(model: OrthrusForCausalLM, w: PrefixWorkload, slots: int = 8, max_new: int = 64,
                  reps: int = 3, speculative: bool | str = True) -> dict:
    """Prefix cache on vs off on the bare engine, interleaved (see the module docstring)."""
    seq = max(map(len, w.prompts)) + max_new + 1
    engines = {on: OrthrusEngine(model, max_batch_size=slots, max_seq_len=seq, static_shapes=False,
                                 speculative=speculative, prefix_cache=on) for on in (True, False)}
    samples, cold, same = interleaved({"cache_on": lambda: timed_generate(engines[True], w.prompts, max_new),
                                       "cache_off": lambda: timed_generate(engines[False], w.prompts, max_new)}, reps)
    on, off, n = samples["cache_on"], samples["cache_off"], len(w.prompts)
    row_mean = statistics.mean(w.row_tokens)
    per_row = med(on, "prefill_tokens") / n
    report = {"rows": n, "slots": slots, "max_new_tokens": max_new, "speculative": speculative, "reps": reps,
              "shared_prefix_tokens": w.shared_tokens, "prefix_examples": w.examples,
              "row_tokens": {"mean": row_mean, "min": min(w.row_tokens), "max": max(w.row_tokens)},
              "completions_identical": same}
    for name, cells in samples.items():
        report[name] = {"rows_per_s": med(cells, "rows_per_s"), "tokens_per_s": med(cells, "tokens_per_s"),
                        "prefill_tokens_per_row": med(cells, "prefill_tokens") / n,
                        "hit_tokens_per_row": med(cells, "hit_tokens") / n,
                        "cold_prefill_tokens_per_row": cold[name]["prefill_tokens"] / n}
    report["rows_per_s_on_over_off"] = report["cache_on"]["rows_per_s"] / report["cache_off"]["rows_per_s"]
    report["median_of_pair_ratios"] = pair_ratio(on, off, "rows_per_s")
    report["prefill_per_row_over_row_part"] = per_row / row_mean
    report["targets"] = {"rows_per_s_ratio >= 2.0": report["rows_per_s_on_over_off"] >= 2.0,
                         "prefill_per_row <= 1.2x row part": report["prefill_per_row_over_row_part"] <= 1.2,
                         "completions identical": same}
    return report


def job_prefix(model_path: str, w: PrefixWorkload, config: str, slots: int = 8, max_new: int = 64,
               speculative: bool | str = True) -> dict:
    """The workload as text through the Ray Data job, ``engine.prefix_cache`` true vs false."""
    from pipeline.config import EngineKwargs       # pydantic, Ray: imported where the job runs
    if "prefix_cache" not in EngineKwargs.model_fields:
        return {"skipped": "the job's config has no engine.prefix_cache key yet (pipeline/config.py)"}
    import subprocess
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.bench.job import run_job
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-prefix-"))
    (tmp / "in").mkdir()
    pq.write_table(pa.table({"id": [f"p{i:04d}" for i in range(len(w.row_texts))],
                             "prompt": [w.prefix_text + t for t in w.row_texts]}), tmp / "in" / "rows.parquet")
    sets = ["prompt.chat_template=off", "sampling.stop=[]", "sampling.temperature=0",
            f"sampling.max_new_tokens={max_new}", f"engine.speculative={json.dumps(speculative)}",
            f"engine.max_batch_size={slots}", f"input.paths=[{tmp / 'in'}]", f"model.path={model_path}"]
    report: dict = {"rows": len(w.row_texts), "slots": slots}
    for name, on in (("cache_on", True), ("cache_off", False)):
        try:
            summary = run_job(config, sets + [f"engine.prefix_cache={str(on).lower()}"], tmp / name)
        except subprocess.CalledProcessError as e:        # recorded: the engine section's numbers stay
            return {**report, "error": f"{name}: exit {e.returncode}: {e.stderr.decode()[-2000:]}"}
        run = summary["run"]
        report[name] = {"steady_tokens_per_s": run["steady_tokens_per_second"], "wall_s": run["wall_seconds"],
                        "tokens_per_s": run["tokens_per_second"], "slot_occupancy": run["slot_occupancy"],
                        "prefill": summary.get("prefill")}
    on, off = report["cache_on"]["steady_tokens_per_s"], report["cache_off"]["steady_tokens_per_s"]
    report["steady_on_over_off"] = on / off if on and off else None
    texts = {name: dict(zip(*pads.dataset(tmp / name / "data", format="parquet")
                            .to_table(columns=["id", "completion"]).to_pydict().values()))
             for name in ("cache_on", "cache_off")}
    report["completions_identical"] = texts["cache_on"] == texts["cache_off"]
    return report


def short_prompts(tok, prompts_dir: str, n: int = 4096, length: int = 3) -> list[list[int]]:
    """``n`` distinct ``length``-token windows of the held-out text (every row's prompt and body, in id order)."""
    seen: dict[tuple[int, ...], None] = {}
    for r in held_out(prompts_dir):
        ids = tok(r["prompt"] + r["reference"])["input_ids"]
        for i in range(0, len(ids) - length + 1):
            seen.setdefault(tuple(ids[i: i + length]))
            if len(seen) == n:
                return [list(p) for p in seen]
    raise ValueError(f"the held-out text has only {len(seen)} distinct {length}-token windows")


def short_outputs(model: OrthrusForCausalLM, prompts: list[list[int]], slots: int = 64,
                  max_new: tuple[int, ...] = (1, 4), reps: int = 5) -> dict:
    """Speculative vs AR-mode rows/s on one engine, per ``max_new_tokens``, interleaved."""
    engine = OrthrusEngine(model, max_batch_size=slots, static_shapes=False,
                           max_seq_len=max(map(len, prompts)) + max(max_new) + 1)
    report: dict = {"rows": len(prompts), "prompt_tokens": len(prompts[0]), "slots": slots, "reps": reps,
                    "threads": torch.get_num_threads(), "by_max_new_tokens": {}}
    for m in max_new:
        samples, _, same = interleaved({mode: (lambda s=s: timed_generate(engine, prompts, m, speculative=s))
                                        for mode, s in (("speculative", True), ("ar", False))}, reps)
        spec, ar = samples["speculative"], samples["ar"]
        cell = {"speculative_rows_per_s": med(spec, "rows_per_s"), "ar_rows_per_s": med(ar, "rows_per_s"),
                "median_of_pair_ratios": pair_ratio(spec, ar, "rows_per_s"), "tokens_identical": same}
        cell["speculative_over_ar"] = cell["speculative_rows_per_s"] / cell["ar_rows_per_s"]
        cell["target >= 0.9"] = cell["speculative_over_ar"] >= 0.9
        report["by_max_new_tokens"][str(m)] = cell
        print(f"short outputs, max_new_tokens={m}: speculative {cell['speculative_rows_per_s']:.0f} rows/s, "
              f"AR {cell['ar_rows_per_s']:.0f} rows/s, ×{cell['speculative_over_ar']:.3f} "
              f"(pairs ×{cell['median_of_pair_ratios']:.3f}), identical: {same}", flush=True)
    return report


def add_args(ap) -> None:
    """The prefix workload's own arguments (3 reps and one thread by default)."""
    ap.add_argument("--sections", default="prefix,short", help="comma list of prefix, short")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="target length of the shared prefix")
    ap.add_argument("--row-tokens", default="20,80", help="min,max tokens of each row's own part")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--speculative", default="true", choices=["true", "false", "auto"],
                    help="the engines' mode in the prefix section")
    ap.add_argument("--short-rows", type=int, default=4096)
    ap.add_argument("--short-prompt-tokens", type=int, default=3)
    ap.add_argument("--short-slots", type=int, default=64)
    ap.add_argument("--short-max-new", default="1,4")
    ap.add_argument("--short-reps", type=int, default=5)
    ap.set_defaults(reps=3, threads=1)    # reps: of the prefix section; the issue measured with one thread


def run(args: argparse.Namespace) -> dict:
    """Every section asked for → the report (printed as it goes)."""
    from transformers import AutoTokenizer
    common.set_threads(args)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = common.load_model(args.model)
    sections = [s for s in args.sections.split(",") if s]
    spec = {"true": True, "false": False, "auto": "auto"}[args.speculative]
    report: dict = {"model": args.model, "threads": torch.get_num_threads()}
    if "prefix" in sections:
        lo, hi = (int(x) for x in args.row_tokens.split(","))
        w = prefix_workload(tok, args.prompts, args.rows, args.prefix_tokens, (lo, hi))
        report["prefix_engine"] = engine_prefix(model, w, args.slots, args.max_new_tokens, args.reps, spec)
        print_prefix(report["prefix_engine"])
        if args.job:
            report["prefix_job"] = job_prefix(args.model, w, args.job_config, args.slots, args.max_new_tokens, spec)
            print(f"prefix workload through the Ray job: {report['prefix_job']}", flush=True)
    if "short" in sections:
        prompts = short_prompts(tok, args.prompts, args.short_rows, args.short_prompt_tokens)
        report["short_outputs"] = short_outputs(model, prompts, args.short_slots,
                                                tuple(int(x) for x in args.short_max_new.split(",")), args.short_reps)
    return report


def print_prefix(r: dict) -> None:
    """The engine prefix section's one printed line."""
    on, off = r["cache_on"], r["cache_off"]
    print(f"shared prefix ({r['shared_prefix_tokens']} tokens, rows' own part {r['row_tokens']['mean']:.1f} "
          f"tokens on average), {r['rows']} rows, {r['slots']} slots: cache on {on['rows_per_s']:.2f} rows/s, "
          f"off {off['rows_per_s']:.2f} rows/s, ×{r['rows_per_s_on_over_off']:.2f} "
          f"(pairs ×{r['median_of_pair_ratios']:.2f}); prompt tokens computed per row once cached "
          f"{on['prefill_tokens_per_row']:.1f} (×{r['prefill_per_row_over_row_part']:.2f} the row part; "
          f"off: {off['prefill_tokens_per_row']:.1f}); completions identical: {r['completions_identical']}", flush=True)


def main(args: argparse.Namespace) -> None:
    """The sections asked for → ``bench-results/prefix.json``."""
    common.write_report(args, run(args))
