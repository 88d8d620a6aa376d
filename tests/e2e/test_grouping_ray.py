"""Prefix grouping through the job on a real local Ray head: the same completions with and without
it, fewer prompt tokens computed with it, and the summary's ideal against the exact one."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from pipeline.output.prefix_ideal import exact_ideal
from support.job_inputs import job_config, write_shard

# Four ~200-token templates and a KV pool of 16 pages (256 tokens) that holds one of them: shuffled
# rows mostly miss the cache (a row's second sample hits), grouped ones mostly hit it.
TEMPLATES = [f"# module {t}\n" + "".join(f"def helper_{t}_{k}(x):\n    return x * {k + t}\n" for k in range(12))
             for t in range(4)]


def _run(tmp_path, model, grouping: bool) -> tuple[dict, dict]:
    from pipeline.run.cluster import connect
    from pipeline.run.job import preflight, run

    cfg = job_config(tmp_path, model, output={"path": str(tmp_path / f"out-{grouping}")},
                     prompt={"chat_template": "off"},
                     # greedy: a prefix-cache hit computes a prompt's tail against K/V another row's
                     # prefill wrote, the same values up to float rounding, which a sampled row's
                     # uniform draw can land on (greedy needs an exact tie); with the cache off,
                     # sampled rows are identical with and without grouping too
                     sampling={"max_new_tokens": 6, "n": 2},
                     # one batch in flight: Ray starts an async actor's calls out of order, so with
                     # several in flight the order batches reach the engine varies from run to run
                     # (computed tokens 1,294-2,062 grouped, 3,294-3,870 not, with 4 in flight)
                     engine={"max_batch_size": 1, "max_seq_len": 240, "kv_cache_tokens": 256, "batch_size": 8,
                             "max_concurrent_batches": 1, "prefix_grouping": grouping}, resources={"replicas": 1})
    run(preflight(cfg), connect())
    out = tmp_path / f"out-{grouping}"
    rows = {(r["id"], r["sample_index"]): r["completion"]
            for r in pq.read_table(out / "data").to_pylist()}
    return rows, json.loads((out / "summary.json").read_text())


def test_grouping_keeps_completions_and_computes_fewer_prompt_tokens(driver, tiny_orthrus_dir, tmp_path):
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(TEMPLATES), 24)
    prompts = [f"{TEMPLATES[t]}def task_{i}(y):" for i, t in enumerate(picks)]
    write_shard(tmp_path, "a.parquet", id=[f"r{i}" for i in range(len(prompts))], prompt=prompts)
    off_rows, off = _run(tmp_path, tiny_orthrus_dir, grouping=False)
    on_rows, on = _run(tmp_path, tiny_orthrus_dir, grouping=True)
    assert on_rows == off_rows and len(on_rows) == 48                       # the same completions, every sample
    computed = {name: s["prefill"]["computed_tokens"] for name, s in (("off", off), ("on", on))}
    assert computed["on"] < 0.6 * computed["off"], computed
    print(f"prompt tokens computed {computed}, ideal {on['prefill']['ideal_computed_tokens']}")
    tok = AutoTokenizer.from_pretrained(tiny_orthrus_dir)
    ids = [tok(p)["input_ids"] for p in prompts for _ in range(2)]
    for s in (on, off):
        assert s["prefill"]["ideal_computed_tokens"] == pytest.approx(exact_ideal(ids, 16), rel=0.05)
        assert s["prefill"]["ideal_computed_tokens"] <= s["prefill"]["computed_tokens"] * 1.05
