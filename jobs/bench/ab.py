"""No workload gets slower: the engine at a git ref and the working tree's engine, side by side in ONE
process, on the plain benchmark workload (no shared prefixes).

    python -m jobs.bench ab                         # --before HEAD; writes bench-results/ab.json
    python -m jobs.bench ab --before 3e018ee

``orthrus/`` at ``--before`` is extracted with ``git archive`` into a temporary directory as the
package ``orthrus_before`` (its absolute ``orthrus`` imports rewritten) and imported next to the
working tree's ``orthrus``; each loads the same checkpoint with its own ``OrthrusForCausalLM``. Per
batch size B (``--batch-sizes``) and mode (speculative, AR): max(B, ``--min-rows``) held-out prompts
through B slots, greedy, ``--max-new-tokens`` new tokens, one thread by default; old and new run in
interleaved pairs (order alternating; the first pair a warm-up). Reported per cell: tokens/s of
each (medians), new ÷ old as the ratio of medians and as the median of the pair ratios, and whether
both generated the same tokens (they must: both engines are exact).
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import inspect
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from jobs.bench import common
from jobs.bench.common import REPO

MODES = {"orthrus": True, "ar": False}
_IMPORT = re.compile(r"^(\s*)(from|import)(\s+)orthrus\b", re.M)


def load_before(ref: str, repo: Path = REPO, name: str = "orthrus_before"):
    """``orthrus/`` at git ``ref`` imported as package ``name`` (a fresh temporary copy; ``name_1``,
    ``name_2``, … if that name is taken) → the module."""
    base, n = name, 0
    while name in sys.modules:
        n += 1
        name = f"{base}_{n}"
    tar = subprocess.run(["git", "-C", str(repo), "archive", ref, "orthrus"], check=True, capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="orthrus-ab-"))
    atexit.register(shutil.rmtree, root, True)   # kept until exit: the package imports lazily too
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(root)
    (root / "orthrus").rename(root / name)
    for py in (root / name).rglob("*.py"):
        # import statements, and module names in strings (a lazy attribute's ``"orthrus.engine.engine"``)
        py.write_text(_IMPORT.sub(rf"\1\2\3{name}", py.read_text()).replace('"orthrus.', f'"{name}.'))
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))       # the package stays imported; nothing else resolves there


def describe(ref: str, repo: Path = REPO) -> dict:
    """The commits compared: ``ref`` resolved, and HEAD with whether the working tree's engine differs."""
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    return {"before": ref, "before_commit": git("rev-parse", ref), "head_commit": git("rev-parse", "HEAD"),
            "orthrus_differs_from_before": bool(git("diff", "--stat", ref, "--", "orthrus"))}


def make_engine(pkg, model, b: int, max_seq_len: int):
    """``pkg.OrthrusEngine`` with B slots, eager, passing only the arguments that version accepts."""
    kwargs = {"max_batch_size": b, "max_seq_len": max_seq_len, "static_shapes": False}
    accepted = inspect.signature(pkg.OrthrusEngine).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):   # settings by name
        return pkg.OrthrusEngine(model, **kwargs)
    return pkg.OrthrusEngine(model, **{k: v for k, v in kwargs.items() if k in accepted})


# What a synthetic-data job's rows typically ask for: the penalties cell puts them on every row.
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1, logit_bias={0: -5.0})


def timed(pkg, engine, prompts: list[list[int]], max_new: int, speculative: bool, options: dict | None = None) -> dict:
    """One greedy ``generate`` (every row with ``options``, e.g. penalties) → tokens/s and the token ids."""
    params = [pkg.SamplingParams(max_new_tokens=max_new, seed=i, **(options or {})) for i in range(len(prompts))]
    seconds, outs = common.time_generate(engine, prompts, params, speculative)
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "ids": [o.token_ids for o in outs]}


def ab_cell(sides: dict, prompts: list[list[int]], max_new: int, speculative: bool, reps: int) -> dict:
    """Interleaved old/new pairs on one workload (order alternating; pair 0 a warm-up) → the cell.
    ``sides``: name ("old", "new") → (package, engine)."""
    r = common.rounds({side: (lambda side=side: timed(*sides[side], prompts, max_new, speculative))
                       for side in ("new", "old")}, reps)
    samples = r.samples
    old, new = common.med(samples["old"], "tok_s"), common.med(samples["new"], "tok_s")
    return {"old_tok_s": old, "new_tok_s": new, "ratio_of_medians": new / old,
            "median_of_pair_ratios": common.pair_ratio(samples["new"], samples["old"], "tok_s"),
            "old_runs_tok_s": [c["tok_s"] for c in samples["old"]],
            "new_runs_tok_s": [c["tok_s"] for c in samples["new"]],
            "tokens_identical": r.ids["old"][-1] == r.ids["new"][-1]}


def options_cell(pkg, engine, prompts: list[list[int]], max_new: int, speculative: bool, reps: int) -> dict:
    """The working tree's engine with every row penalised (:data:`PENALTIES`) vs the same rows
    without, in interleaved pairs → what penalties cost a batch (the tokens differ, so tok/s)."""
    r = common.rounds({side: (lambda side=side: timed(pkg, engine, prompts, max_new, speculative,
                                                      PENALTIES if side == "penalties" else None))
                       for side in ("penalties", "plain")}, reps)
    s = r.samples
    return {"plain_tok_s": common.med(s["plain"], "tok_s"), "penalties_tok_s": common.med(s["penalties"], "tok_s"),
            "median_of_pair_ratios": common.pair_ratio(s["penalties"], s["plain"], "tok_s"), "options": str(PENALTIES)}


def run(before: str, model_dir: str, prompts_dir: str, sizes: list[int], reps: int, max_new: int,
        min_rows: int, penalties: bool = False) -> dict:
    """Old vs new per batch size and mode (with ``penalties``, also what penalising every row costs
    the new engine) → the report (printed as it goes)."""
    import orthrus as new_pkg
    old_pkg = load_before(before)
    models = {side: pkg.OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
              for side, pkg in (("old", old_pkg), ("new", new_pkg))}
    prompts = common.load_prompts(model_dir, prompts_dir)[1]
    report: dict = {**describe(before), "model": model_dir, "threads": torch.get_num_threads(), "reps": reps,
                    "max_new_tokens": max_new, "min_rows": min_rows, "results": {}}
    for b in sizes:
        rows = [prompts[i % len(prompts)] for i in range(max(b, min_rows))]
        seq = min(1024, models["new"].config.max_position_embeddings)
        sides = {side: (pkg, make_engine(pkg, models[side], b, seq))
                 for side, pkg in (("old", old_pkg), ("new", new_pkg))}
        for mode, spec in MODES.items():
            cell = ab_cell(sides, rows, max_new, spec, reps)
            report["results"][f"B={b} {mode}"] = cell
            print(f"B={b:<3} {mode:<7} old {cell['old_tok_s']:.0f} tok/s, new {cell['new_tok_s']:.0f} tok/s: "
                  f"new/old ×{cell['ratio_of_medians']:.3f} (pairs ×{cell['median_of_pair_ratios']:.3f}), "
                  f"tokens identical: {cell['tokens_identical']}", flush=True)
            if penalties:
                pen = options_cell(new_pkg, sides["new"][1], rows, max_new, spec, reps)
                report["results"][f"B={b} {mode} penalties"] = pen
                print(f"B={b:<3} {mode:<7} every row penalised: ×{pen['median_of_pair_ratios']:.3f} of the same "
                      f"rows without ({pen['penalties_tok_s']:.0f} vs {pen['plain_tok_s']:.0f} tok/s)", flush=True)
    return report


def add_args(ap) -> None:
    """``--before`` (the old engine's git ref); batch sizes default to 1,4,16,64, one thread."""
    ap.add_argument("--before", default="HEAD", help="git ref of the old engine (default HEAD: the last commit)")
    ap.add_argument("--penalties", action="store_true",
                    help="also time the new engine with every row penalised vs the same rows without")
    ap.set_defaults(batch_sizes="1,4,16,64", threads=1)


def main(args: argparse.Namespace) -> None:
    """Old vs new at ``--batch-sizes`` → ``bench-results/ab.json``."""
    common.set_threads(args)
    report = run(args.before, args.model, args.prompts, common.batch_sizes(args, "1,4,16,64"), args.reps,
                 args.max_new_tokens, args.min_rows, getattr(args, "penalties", False))
    common.write_report(args, report)
