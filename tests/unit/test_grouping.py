"""Prefix grouping (``pipeline/requests/grouping.py``) and the run's ideal prefill
(``pipeline/output/prefix_ideal.py``), on the host: orders, windows and sketches."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import PREPARE_ROWS, ConfigError
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import read_file
from pipeline.output import prefix_ideal as PI
from pipeline.output import stats as St
from pipeline.processor.config import processor_config
from pipeline.requests.grouping import prompt_order
from pipeline.run.job import preflight
from support.job_inputs import job_config, write_shard

IDS = pa.list_(pa.int32())


def _prompts(rng: np.random.Generator, n: int) -> list[list[int] | None]:
    """Templates of ids across byte boundaries (255/256, 65535/65536), tails, duplicates,
    prefixes of one another and nulls."""
    edges = [0, 1, 255, 256, 65535, 65536, 151_000]
    templates = [list(rng.choice(edges, 5)) for _ in range(4)]
    out: list[list[int] | None] = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.1:
            out.append(None)
        elif roll < 0.2 and out and out[-1] is not None:
            out.append(list(out[-1]))                                  # a duplicate: ties by position
        else:
            t = templates[rng.integers(len(templates))]
            out.append(t[: rng.integers(1, len(t) + 1)] + list(rng.choice(edges, rng.integers(0, 4))))
    return out


def test_order_is_token_order_ties_by_position_errors_last():
    rng = np.random.default_rng(3)
    for _ in range(20):
        prompts = _prompts(rng, 60)
        order = prompt_order(pa.array(prompts, IDS)).tolist()
        valid = sorted((p, i) for i, p in enumerate(prompts) if p is not None)    # lists compare as tokens
        assert order == [i for _, i in valid] + [i for i, p in enumerate(prompts) if p is None]


def test_the_job_window_leaves_grouped_with_every_row_and_samples_together(tmp_path, weightless_model):
    themes = ["def area(r):\n    return", "class Stack:\n    def push(self, x):", "import os\nos.path"]
    rng = np.random.default_rng(0)
    picks = rng.integers(0, 3, 24)
    write_shard(tmp_path, "a.parquet", id=[f"r{i}" for i in range(24)],
                prompt=[f"{themes[t]} # {i}" if i != 5 else "" for i, t in enumerate(picks)])
    cfg = job_config(tmp_path, weightless_model, sampling={"n": 2, "seed": 1}, prompt={"chat_template": "off"})
    inputs = preflight(cfg).inputs
    plain, grouped = (preprocess_batch(read_file(inputs, 0, 2), PreprocessPlan(inputs, cfg.model, cfg.prompt,
                                                                              cfg.sampling, group=g)).to_pylist()
                      for g in (False, True))
    key = lambda r: (r["id"], r["sample_index"])                        # noqa: E731
    assert sorted(map(key, grouped)) == sorted(map(key, plain)) and len(grouped) == 48
    by_key = {key(r): r for r in plain}
    timing = (PI.SKETCH, "__startup")     # the ideal-prefill sketch and when the call ran (first row only)
    assert all({k: v for k, v in r.items() if k not in timing} == {k: v for k, v in by_key[key(r)].items()
                                                                    if k not in timing} for r in grouped)
    prompts = [r["__request"]["prompt_token_ids"] for r in grouped if r["__request"] is not None]
    assert prompts == sorted(prompts) and prompts != [r["__request"]["prompt_token_ids"] for r in plain
                                                      if r["__request"] is not None]
    assert grouped[-2]["id"] == grouped[-1]["id"] == "r5" and grouped[-1]["error"]      # the error row last
    ok = [key(r) for r in grouped if r["__request"] is not None]
    assert all(ok[i][0] == ok[i + 1][0] for i in range(0, len(ok), 2))                  # samples side by side
    assert sum(r[PI.SKETCH] is not None for r in grouped) == 1 and grouped[0][PI.SKETCH] is not None


def test_window_and_processor_switches(weightless_model):
    from ray.data import DataContext
    from pipeline.processor.build import grouping_on

    base = {"model_source": str(weightless_model)}
    assert processor_config(base).prepare_window(32) == PREPARE_ROWS
    assert processor_config(base).prepare_window(4096) == 4096
    assert processor_config({**base, "prefix_grouping_rows": 200}).prepare_window(4096) == 200
    with pytest.raises(ConfigError, match="prefix_grouping_rows"):
        processor_config({**base, "prefix_grouping_rows": 0})
    ctx = DataContext.get_current()
    before = ctx.execution_options.preserve_order
    try:
        ctx.execution_options.preserve_order = False
        assert grouping_on(processor_config(base)) and not grouping_on(processor_config(
            {**base, "prefix_grouping": False}))
        ctx.execution_options.preserve_order = True     # the user asked for their order: left alone
        assert not grouping_on(processor_config(base))
    finally:
        ctx.execution_options.preserve_order = before


def _templated(rng: np.random.Generator, templates: int, rows: int) -> list[list[int]]:
    heads = [list(rng.integers(0, 150_000, rng.integers(300, 600))) for _ in range(templates)]
    return [heads[rng.integers(templates)] + list(rng.integers(0, 150_000, rng.integers(1, 80))) for _ in range(rows)]


@pytest.mark.parametrize("templates", [1, 30, 3000])
def test_the_sketched_ideal_is_within_a_few_percent_of_the_exact_one(templates):
    rng = np.random.default_rng(templates)
    prompts = _templated(rng, templates, 3000)
    prompts += [prompts[0][:16], prompts[0][:17], prompts[0][:33], list(prompts[1])]   # page-edge prefixes, a copy
    windows = [prompts[i:i + 500] for i in range(0, len(prompts), 500)]
    share = None
    for w in windows:       # as the driver sees them: one sketch per window, merged across blocks
        block = pa.table({"num_input_tokens": pa.array([len(p) for p in w], pa.int64()),
                          "error": pa.nulls(len(w), pa.string())})
        block = PI.with_sketch(block, pa.array(w, IDS))
        share = PI.merge(share, PI.of_block(block))
    # its rows' sums count where they commit (here: nowhere again), its sketch merges once more
    resketched = PI.with_sketch(pa.table({"num_input_tokens": pa.array([0] * len(w), pa.int64())}), pa.array(w, IDS))
    again = PI.merge(share, PI.of_block(resketched))
    for page in PI.PAGES:
        exact = PI.exact_ideal(prompts, page)
        assert PI.ideal_computed_tokens(share, page) == pytest.approx(exact, rel=0.03)
        # a window sketched twice (a resumed run re-reads rows whose sketch committed) counts once
        assert PI.ideal_computed_tokens(again, page) == PI.ideal_computed_tokens(share, page)
    assert PI.ideal_computed_tokens(share, 64) is None


def test_exact_ideal_counts_whole_pages_shared_with_the_predecessor():
    a = list(range(40))
    assert PI.exact_ideal([a], 16) == 40
    assert PI.exact_ideal([a, a], 16) == 40 + 40 - 32                    # shares 2 pages; its last token is computed
    assert PI.exact_ideal([a, a[:32]], 16) == 40 + 32 - 16               # a 32-token prompt shares at most 1 page
    assert PI.exact_ideal([a, a[:16] + [99] * 24], 16) == 40 + 40 - 16


def test_footers_carry_the_ideal_through_the_prefill_merge():
    prompts = [list(range(100)), list(range(100)) + [7]]
    block = PI.with_sketch(pa.table({"num_input_tokens": pa.array([100, 101], pa.int64()),
                                     "error": pa.array([None, None], pa.string())}), pa.array(prompts, IDS))
    merged = St.merge(St.of_table(pa.table({"id": ["a"], "finish_reason": ["stop"], "error": pa.array([None], pa.string())}),
                                  St.prefill_of_block(block)), St.empty())
    decoded = St.decode(St.encode(merged))
    assert PI.ideal_computed_tokens(decoded["prefill"]["ideal"], 16) == PI.exact_ideal(prompts, 16) == 100 + 101 - 96
