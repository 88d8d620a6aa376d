"""Hostile rows, extreme values and unusual column types, without Ray: each becomes an error row, its
limit, a lossless conversion, or an up-front refusal naming the column and the file.

The same inputs run end to end through a real Ray head in ``tests/test_hardening_ray.py``.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.sampling import SamplingTensors, process
from pipeline.config import ConfigError
from pipeline.job import preflight
from pipeline.preprocess import PreprocessPlan, preprocess_batch
from test_pipeline_units import _config, _shard, weightless_model  # noqa: F401 - fixture reused

MSG = '[{"role": "user", "content": "%s"}]'
DEEP = "[" * 100_000 + "]" * 100_000                                   # legal JSON, deeper than Python recurses
HUGE_INT = '[{"role": "user", "content": "x", "n": %s}]' % ("9" * 5000)  # over Python's int-digit limit


def hostile_rows() -> tuple[pa.Table, dict[str, str | None]]:
    """One shard of rows that each once killed a batch; id -> expected error substring (None = fine)."""
    ids = ["ok", "deep-json", "huge-int-json", "top_k-u64", "max-f64", "seed-u64", "tiny-temp", "tiny-top-p"]
    table = pa.table({
        "id": ids,
        "messages": [MSG % "hi", DEEP, HUGE_INT] + [MSG % f"row {i}" for i in range(5)],
        "top_k": pa.array([None, None, None, 2 ** 64 - 1, None, None, None, None], pa.uint64()),
        "max_new_tokens": pa.array([None, None, None, None, 1e300, None, None, None], pa.float64()),
        "seed": pa.array([None, None, None, None, None, 2 ** 63, None, None], pa.uint64()),
        "temperature": pa.array([None] * 6 + [1e-300, 0.7], pa.float64()),
        "top_p": pa.array([None] * 7 + [1e-300], pa.float64()),
    })
    expected = {"ok": None, "deep-json": "messages is JSON this job cannot read: RecursionError",
                "huge-int-json": "messages is JSON this job cannot read: ValueError",
                "top_k-u64": "column 'top_k' holds 18446744073709551615, outside the 64-bit integer range",
                "max-f64": "column 'max_new_tokens' holds 1e+300, outside the 64-bit integer range",
                "seed-u64": "column 'seed' holds 9223372036854775808, outside the 64-bit", "tiny-temp": None, "tiny-top-p": None}
    return table, expected


def test_hostile_rows_become_error_rows_and_extreme_values_their_limits(tmp_path, weightless_model):
    table, expected = hostile_rows()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "hostile.parquet")
    cfg = _config(tmp_path, weightless_model, sampling={"n": 2})
    inputs = preflight(cfg).inputs
    out = preprocess_batch(pq.read_table(inputs.files[0]), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    assert out.num_rows == 2 * table.num_rows                          # rows in x n == rows out
    for r in out.to_pylist():
        want = expected[r["id"]]
        if want is None:
            assert r["error"] is None and r["__prompt_token_ids"], r
        else:
            assert r["error"] and want in r["error"], (r["id"], r["error"])
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["tiny-temp"]["__temperature"] == 0.0                    # its limit: greedy
    assert rows["tiny-top-p"]["__top_p"] == 1e-30                       # its limit: the top token only


def test_extreme_sampling_values_behave_as_their_limits_in_the_engine(tiny_orthrus_dir):
    model = OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir), dtype=torch.float32)
    engine = OrthrusEngine(model, max_batch_size=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    greedy = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=20))]
    for extreme in (SamplingParams(temperature=1e-300, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=1e-6, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=0.9, top_p=1e-300, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=0.9, top_p=1e-40, max_new_tokens=20, seed=1)):
        assert [r.token_ids for r in engine.generate(prompts, extreme)] == greedy, extreme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_processing_never_yields_nan_probabilities(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 3, 500) * 40).to(dtype)
    logits[0, 0, 7] = torch.finfo(dtype).max                    # an extreme logit
    temps = [SamplingParams(temperature=t).temperature for t in (1e-300, 1e-5, 0.7, 1e30, 1e300, 0.0)]
    top_p = [SamplingParams(top_p=p).top_p for p in (1e-300, 1e-30, 0.5, 1.0, 1e-45, 1.0)]
    st = SamplingTensors(torch.tensor(temps, dtype=torch.float64), torch.tensor([0, 5, 0, 0, 1, 0]),
                         torch.tensor(top_p, dtype=torch.float64), torch.tensor([t == 0 for t in temps]),
                         filtered=True, all_greedy=False)
    probs = process(logits, st)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(6, 3, dtype=probs.dtype))


# ---------------------------------------------------------------- pass-through column types and hive partitions

def test_view_types_and_hive_partitions_pass_through(tmp_path, weightless_model):
    (tmp_path / "in" / "lang=en" / "year=2024").mkdir(parents=True)
    (tmp_path / "in" / "lang=fr" / "year=2025").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "v": pa.array(["s", "t"], pa.string_view()),
                             "lv": pa.array([[1], [2, 3]], pa.list_view(pa.int64())),
                             "bv": pa.array([b"x", b"y"], pa.binary_view())}),
                   tmp_path / "in" / "lang=en" / "year=2024" / "a.parquet")
    pq.write_table(pa.table({"id": ["c"], "prompt": ["r"]}), tmp_path / "in" / "lang=fr" / "year=2025" / "b.parquet")
    cfg = _config(tmp_path, weightless_model)
    inputs = preflight(cfg).inputs
    assert inputs.passthrough == ("v", "lv", "bv", "lang", "year")
    assert [f.type for f in inputs.passthrough_fields] == [pa.string(), pa.list_(pa.int64()), pa.binary(),
                                                           pa.string(), pa.string()]
    batch = pq.read_table(inputs.files[0], partitioning=None)
    out = preprocess_batch(batch, PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    assert out.select(["v", "lv", "bv"]).to_pylist() == [{"v": "s", "lv": [1], "bv": b"x"},
                                                          {"v": "t", "lv": [2, 3], "bv": b"y"}]


@pytest.mark.parametrize("second, message", [
    (pa.array([0.5], pa.float64()), r"input column 'big' is int64 in .*a.parquet but double in another input file, "
                                    r"and a value here does not convert exactly"),
])
def test_a_column_that_cannot_be_carried_is_refused_up_front(tmp_path, weightless_model, second, message):
    _shard(tmp_path, "a.parquet", id=["a", "b"], prompt=["p", "q"], big=pa.array([2 ** 60 + 1, 3], pa.int64()))
    _shard(tmp_path, "b.parquet", id=["c"], prompt=["r"], big=second)
    with pytest.raises(ConfigError, match=message):
        preflight(_config(tmp_path, weightless_model))


def test_a_partition_key_that_is_also_a_column_is_refused(tmp_path, weightless_model):
    (tmp_path / "in" / "lang=en").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "lang": ["de"]}), tmp_path / "in" / "lang=en" / "a.parquet")
    with pytest.raises(ConfigError, match=r"input column 'lang' is also a hive partition key in the path of"):
        preflight(_config(tmp_path, weightless_model))
