"""Sampling at Qwen3's vocabulary (V = 151,936): what top-k / top-p cost per engine call, before and
after issue #23 (top-k / top-p without sorting the whole vocabulary).

    python -m jobs.bench vocab                 # writes bench-results/vocab.json

Model: random weights with the bundled model's shapes (``models/tiny-orthrus-py/config.json``) but
Qwen3's vocabulary (151,936, mask token 151,669), in two variants: "flat" as initialised (a random
LM head: the nucleus holds most of the vocabulary) and "peaked" (the final norm's gain scaled so the
logits spread like a trained model's: a nucleus of a few to a few hundred tokens). Speculative and
AR decoding, greedy and sampled (temperature 0.8, top_p 0.95), B rows decoded together, interleaved
in one process on one torch thread; each cell is the median of ``--reps`` repetitions after a short
warm-up. "sampled (full sort)" is the same engine with ``process`` swapped back to the
implementation before #23 (kept below), so the before/after ratio is measured, not remembered.

Reported per cell: tokens/s, seconds per engine call (a speculative cycle or an AR step: an
iteration over the batch), the ratio of a sampled call to a greedy call, and where a call's time
goes: the model body (``forward_cached``), the LM head (``logits``), sampling and acceptance
(``process``, ``sample``, ``accept``, ``greedy_accept``, the uniforms; timed by wrapping them here,
nothing in the engine), and the rest: host bookkeeping (scheduling, the packed read, stops) plus the
device-side commit and the greedy paths' inline argmaxes. Larger batches decode fewer tokens per row
(``tokens_for``) to fit the run in about ten minutes on two CPU cores; per-call figures do not
depend on that.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from transformers import Qwen3Config

from jobs.bench import common
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams, rng, sampling
from orthrus.engine.device import kernels as decode
from orthrus.sampling import SamplingTensors

QWEN3_VOCAB, QWEN3_MASK, QWEN3_EOS = 151_936, 151_669, [151_645, 151_643]
SETTINGS = ("greedy", "sampled", "sampled (full sort)")
SAMPLED = dict(temperature=0.8, top_p=0.95)
PEAKED_LOGIT_STD = 6.0          # logits' spread in the peaked variant: a nucleus of ~2-40 tokens


# ---------------------------------------------------------------- the implementation before #23

def full_sort_filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, stable: bool = False) -> torch.Tensor:
    """Top-k then top-p on tempered logits ``[b, T, V]`` by sorting the whole vocabulary (before #23;
    ``stable`` orders ties by token id, the rule kept since)."""
    b, t, v = x.shape
    sorted_x, order = x.sort(dim=-1, descending=True, stable=stable)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).clamp(max=v)
    kth = sorted_x.gather(-1, (k - 1)[:, None, None].expand(b, t, 1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sp = sorted_x.softmax(-1)
    mass_before = sp.cumsum(-1) - sp
    drop_sorted = mass_before >= top_p[:, None, None].to(sp.dtype)
    drop_sorted |= sorted_x == float("-inf")
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def full_sort_process(logits: torch.Tensor, st: SamplingTensors, stable: bool = False) -> torch.Tensor:
    """``sampling.process`` as it was before #23."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if st.all_greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    onehot = torch.zeros_like(x).scatter(-1, x.argmax(-1, keepdim=True), 1.0)
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature).to(x.dtype)
    x = x / temp[:, None, None]
    if st.filtered:
        x = full_sort_filter(x, st.top_k, st.top_p, stable)
    return torch.where(st.greedy[:, None, None], onehot, x.softmax(-1))


# ---------------------------------------------------------------- model and timing

def vocab_model(model_dir: str, peaked: bool, seed: int = 0) -> OrthrusForCausalLM:
    """Random weights, the bundled model's shapes, Qwen3's vocabulary; ``peaked`` scales the final
    norm's gain (the LM head is tied to the embeddings, so it is left alone) to PEAKED_LOGIT_STD."""
    cfg = Qwen3Config.from_pretrained(model_dir)
    cfg.vocab_size, cfg.mask_token_id = QWEN3_VOCAB, QWEN3_MASK
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = QWEN3_EOS, QWEN3_EOS[1], QWEN3_EOS[1]
    torch.manual_seed(seed)
    model = OrthrusForCausalLM(cfg).float().eval()
    if peaked:
        with torch.no_grad():
            probe = model(torch.randint(0, 150_000, (2, 32)))          # [2, 32, V]
            model.model.norm.weight.mul_(PEAKED_LOGIT_STD / probe.std())
    return model


class CallSplit:
    """Seconds spent in the body, the LM head and sampling, by wrapping those calls (CPU: no sync)."""

    PARTS = ("forward", "lm_head", "sampling")

    def __init__(self, model: OrthrusForCausalLM) -> None:
        self.model, self.seconds = model, dict.fromkeys(self.PARTS, 0.0)
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        self._saved.append((owner, name, inner))
        setattr(owner, name, timed)

    @contextmanager
    def active(self, process_fn: Callable | None = None):
        """Time the parts (and, with ``process_fn``, run the engine with that ``process``)."""
        if process_fn is not None:
            self._saved.append((decode, "process", decode.process))
            decode.process = process_fn
        self._wrap(self.model, "forward_cached", "forward")
        self._wrap(self.model, "logits", "lm_head")
        for name in ("process", "sample", "accept", "greedy_accept"):
            self._wrap(decode, name, "sampling")
        self._wrap(rng, "uniforms", "sampling")
        try:
            yield self
        finally:
            for owner, name, inner in reversed(self._saved):
                setattr(owner, name, inner)
            self._saved.clear()


def run_once(engine: OrthrusEngine, prompts: list[list[int]], setting: str, speculative: bool,
             tokens: int) -> dict:
    """One ``generate`` of every prompt → seconds, tokens, engine calls and the time split."""
    greedy = setting == "greedy"
    params = [SamplingParams(max_new_tokens=tokens, seed=i, **({} if greedy else SAMPLED))
              for i in range(len(prompts))]
    split = CallSplit(engine.model)
    before = engine.stats.iterations
    with split.active(full_sort_process if setting == "sampled (full sort)" else None):
        start = time.perf_counter()
        out = engine.generate(prompts, params, speculative=speculative)
        seconds = time.perf_counter() - start
    calls = engine.stats.iterations - before
    rest = seconds - sum(split.seconds.values())
    return {"seconds": seconds, "tokens": sum(len(o.token_ids) for o in out), "calls": calls,
            **{f"{part}_s": s for part, s in split.seconds.items()}, "rest_s": rest}


def tokens_for(b: int, max_new: int) -> int:
    """New tokens per row at batch size ``b``: ``max_new`` at B = 1, fewer for larger batches (the
    per-call figures are what the cells compare; this keeps the run near ten minutes)."""
    return max(3, round(max_new / b ** 0.8))


def bench_cell(model: OrthrusForCausalLM, b: int, tokens: int, reps: int, seed: int) -> dict:
    """Interleaved reps of every (mode, setting) at batch size ``b`` → medians and ratios."""
    engine = OrthrusEngine(model, max_batch_size=b, max_seq_len=256, static_shapes=False)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 150_000, (16,), generator=gen).tolist() for _ in range(b)]
    modes = {"speculative": True, "ar": False}
    runs: dict[tuple[str, str], list[dict]] = {(m, s): [] for m in modes for s in SETTINGS}
    for mode, spec in modes.items():                                  # warm-up: first allocations
        for setting in SETTINGS[:2]:
            run_once(engine, prompts, setting, spec, 2)
    for rep in range(reps):
        for mode, spec in modes.items():
            for setting in common.rotated(SETTINGS, rep):                # drift hits every setting
                runs[mode, setting].append(run_once(engine, prompts, setting, spec, tokens))
    cells: dict = {"tokens_per_row": tokens}
    for mode in modes:
        cells[mode] = {s: _median(runs[mode, s]) for s in SETTINGS}
        per_call = {s: c["seconds"] / c["calls"] for s, c in cells[mode].items()}
        cells[mode]["sampled_over_greedy"] = per_call["sampled"] / per_call["greedy"]
        cells[mode]["full_sort_over_greedy"] = per_call["sampled (full sort)"] / per_call["greedy"]
        cells[mode]["full_sort_over_sampled"] = per_call["sampled (full sort)"] / per_call["sampled"]
    return cells


def _median(samples: list[dict]) -> dict:
    cell = common.median_cell(samples)
    cell["tokens_per_s"] = cell["tokens"] / cell["seconds"]
    cell["ms_per_call"] = 1000 * cell["seconds"] / cell["calls"]
    for part in (*CallSplit.PARTS, "rest"):
        cell[f"{part}_ms_per_call"] = 1000 * cell[f"{part}_s"] / cell["calls"]
    return cell


def nucleus_sizes(model: OrthrusForCausalLM, seed: int = 1) -> dict:
    """How peaked a variant is: tokens kept at temperature 0.8 / top_p 0.95 over prompt positions,
    and the share of positions whose nucleus outruns the candidates (and so takes the sort)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(torch.randint(0, 150_000, (4, 24), generator=gen))           # [4, 24, V]
    st = SamplingTensors(torch.full((4,), 0.8, dtype=torch.float64), torch.zeros(4, dtype=torch.long),
                         torch.full((4,), 0.95, dtype=torch.float64), torch.zeros(4, dtype=torch.bool), True)
    kept = (sampling.process(logits, st) > 0).sum(-1).flatten().float()
    q = torch.quantile(kept, torch.tensor([0.1, 0.5, 0.9]))
    return {"p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]),
            "share_past_candidates": float((kept > sampling.CANDIDATES).float().mean())}


def run(model_dir: str = "models/tiny-orthrus-py", batch_sizes: Sequence[int] = (1, 8, 32), reps: int = 3,
        max_new_tokens: int = 48) -> dict:
    """Every variant × batch size → the report (printed as it goes)."""
    report: dict = {"model": f"{model_dir} shapes, V = {QWEN3_VOCAB}, random weights",
                    "threads": torch.get_num_threads(), "reps": reps, "sampled": SAMPLED,
                    "candidates": sampling.CANDIDATES, "variants": {}}
    for variant in ("peaked", "flat"):
        model = vocab_model(model_dir, peaked=variant == "peaked")
        entry: dict = {"nucleus": nucleus_sizes(model), "results": {}}
        print(f"{variant}: nucleus at T=0.8, top_p=0.95: {entry['nucleus']}", flush=True)
        for b in batch_sizes:
            cells = bench_cell(model, b, tokens_for(b, max_new_tokens), reps, seed=b)
            entry["results"][str(b)] = cells
            print_cell(variant, b, cells)
        report["variants"][variant] = entry
    return report


def print_cell(variant: str, b: int, cells: dict) -> None:
    """One variant and batch size, one printed line per mode."""
    for mode in ("speculative", "ar"):
        c = cells[mode]
        parts = " | ".join(
            f"{s}: {c[s]['tokens_per_s']:.1f} tok/s, {c[s]['ms_per_call']:.0f} ms/call "
            f"(body {c[s]['forward_ms_per_call']:.0f}, head {c[s]['lm_head_ms_per_call']:.0f}, "
            f"sampling {c[s]['sampling_ms_per_call']:.0f}, rest {c[s]['rest_ms_per_call']:.0f})" for s in SETTINGS)
        print(f"{variant} B={b:<3} {mode:<11} {parts} | sampled/greedy {c['sampled_over_greedy']:.2f}x, "
              f"full sort/greedy {c['full_sort_over_greedy']:.2f}x, full sort/sampled "
              f"{c['full_sort_over_sampled']:.2f}x", flush=True)


def add_args(ap) -> None:
    """Its defaults: batch sizes 1,8,32, 3 reps, 48 new tokens at B = 1 (fewer for larger batches),
    one thread (other load cannot stall a pool); ``--model`` gives the shapes only (random weights)."""
    ap.set_defaults(batch_sizes="1,8,32", reps=3, max_new_tokens=48, threads=1)


def main(args: argparse.Namespace) -> None:
    """Every variant × ``--batch-sizes`` → ``bench-results/vocab.json``."""
    common.set_threads(args)
    report = run(args.model, common.batch_sizes(args, "1,8,32"), args.reps, args.max_new_tokens)
    common.write_report(args, report)
