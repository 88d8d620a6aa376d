"""The one table of sampling fields (``pipeline/requests/sampling_fields.py``): every field reaches
every place derived from it, and ``min_tokens`` goes through the job, the processor and OpenAI batch
bodies to the real engine (the bundled model: no EOS before N tokens)."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orthrus import SamplingParams
from pipeline.config import ConfigError, EngineKwargs, ModelConfig, SamplingConfig, StorageConfig
from pipeline.config_file import load_config
from pipeline.inputs import openai_batch, plan
from pipeline.inputs.openai_batch import request_row
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import read_file
from pipeline.requests import prepare
from pipeline.requests.errors import RowError
from pipeline.requests.prepare import PreparePlan, prepare_batch, sampling_params_of
from pipeline.requests.prompts import ChatTemplate
from pipeline.requests.request import REQUEST, REQUEST_TYPE, read_requests
from pipeline.requests.sampling_fields import FIELDS, OVERRIDE_COLUMNS, SAMPLING_TYPE
from support.paths import TOKENIZER_DIR

MODEL = TOKENIZER_DIR          # the bundled model: weights and tokenizer
# Greedy, this prompt ends (EOS) after a few tokens on the bundled model.
EARLY_EOS = "def add(a, b):\n    return"


def test_every_field_reaches_every_derived_place():
    engine = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {f.engine for f in FIELDS} == engine                          # a new engine field needs a row
    assert {f.config for f in FIELDS} <= set(SamplingConfig.model_fields)
    request = set(REQUEST_TYPE.names)
    assert request == {"prompt_token_ids", *(f.vllm for f in FIELDS)} and set(SAMPLING_TYPE.names) == request - {
        "prompt_token_ids"}
    assert all(REQUEST_TYPE.field(f.vllm).type == f.arrow for f in FIELDS)
    assert OVERRIDE_COLUMNS == tuple(f.column for f in FIELDS if f.column) and plan.OVERRIDE_COLUMNS is OVERRIDE_COLUMNS
    assert {f.vllm for f in FIELDS} <= set(prepare.SAMPLING_KEYS)
    body = [f for f in FIELDS if f.openai]
    assert {f.openai for f in body} <= set(openai_batch.BODY_KEYS)
    assert all(openai_batch.SCHEMA.field(f.column).type == f.arrow for f in body)


def _job(tmp_path: Path, sampling: dict, **columns):
    (tmp_path / "in").mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), tmp_path / "in" / "rows.parquet")
    return load_config(None, data={"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out")},
                                   "model": {"path": str(MODEL)}, "prompt": {"chat_template": "off"},
                                   "sampling": sampling})


def _job_rows(cfg) -> pa.Table:
    from pipeline.inputs.plan import inspect_inputs

    inputs = inspect_inputs(cfg.input)
    return preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt,
                                                                                 cfg.sampling))


def test_min_tokens_in_the_job_config_is_validated():
    assert SamplingConfig(min_tokens=4, max_new_tokens=4).min_tokens == 4
    for bad, message in (({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_new_tokens": 8}, "<= max_new_tokens"),
                         ({"min_tokens": 2, "structured": {"regex": "a"}}, "min_tokens cannot be combined with structured")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, data={"input": {"paths": ["x"]}, "output": {"path": "y"}, "model": {"path": "m"},
                                    "sampling": bad})


def test_min_tokens_from_the_config_a_column_and_a_bad_column(tmp_path):
    cfg = _job(tmp_path, {"min_tokens": 3, "max_new_tokens": 8}, prompt=["a", "b", "c"], min_tokens=[None, 5, 9])
    rows = _job_rows(cfg)
    requests = read_requests(rows[REQUEST])
    assert [p and p.min_tokens for p in requests.params] == [3, 5, None]
    assert rows["error"].to_pylist()[2] == "column 'min_tokens' must be an int in [0, max_new_tokens=8], got 9"


def test_min_tokens_in_sampling_params_and_an_openai_body():
    assert sampling_params_of({"min_tokens": 3, "max_tokens": 5}).min_tokens == 3
    with pytest.raises(RowError, match=r"^sampling_params.min_tokens must be an int in \[0, max_new_tokens=5\]"):
        sampling_params_of({"min_tokens": 6, "max_tokens": 5})
    body = {"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 5}}
    row, _ = request_row({**body, "body": {**body["body"], "min_tokens": 3}}, None, 1, "b.jsonl")
    assert row["min_tokens"] == 3 and row.get("__input_error") is None
    row, _ = request_row({**body, "body": {**body["body"], "min_tokens": 6}}, None, 1, "b.jsonl")
    assert row["__input_error"] == ("line 1 of b.jsonl: body.min_tokens must be an int in [0, max_new_tokens=5], "
                                    "got 6")
    row, _ = request_row({**body, "body": {**body["body"], "max_completion_tokens": 2, "min_tokens": 3}}, None, 1,
                         "b.jsonl")
    assert row["__input_error"].startswith("line 1 of b.jsonl: body.min_tokens must be an int in [0, max_new_tokens=2]")
    no_max = {**body, "body": {"prompt": "x", "min_tokens": 100}}       # the job's max_new_tokens decides, later
    assert request_row(no_max, None, 1, "b.jsonl")[0]["min_tokens"] == 100


@pytest.fixture(scope="module")
def stage():
    from pipeline.actor.stage import GenerationStage, StagePlan

    return GenerationStage(StagePlan(ModelConfig(path=str(MODEL)), EngineKwargs(max_batch_size=4, dtype="float32"),
                                     use_gpu=False))


def _generated(stage, prepared: pa.Table) -> list[dict]:
    return asyncio.run(stage(prepared)).to_pylist()


def _no_eos_before(row: dict, n: int, eos: frozenset[int]) -> None:
    assert row["error"] is None and row["num_generated_tokens"] >= n, row
    assert not eos.intersection(row["generated_tokens"][:n]), row["generated_tokens"]


def test_min_tokens_end_to_end_on_the_bundled_model(stage, tmp_path):
    """Every source asks for min_tokens=12 where greedy decoding ends at EOS sooner: no EOS before 12."""
    plan = PreparePlan(ModelConfig(path=str(MODEL)), StorageConfig(), ChatTemplate("off"))
    free, processor = _generated(stage, prepare_batch(pa.table({
        "prompt": [EARLY_EOS] * 2, "sampling_params": [{"max_tokens": 24}, {"max_tokens": 24, "min_tokens": 12}]}),
        plan))
    assert free["finish_reason"] == "stop" and free["num_generated_tokens"] < 12    # the case min_tokens changes
    _no_eos_before(processor, 12, stage.eos_ids)
    short = free["generated_tokens"][:-1]                   # up to its EOS, the forced run decodes the same
    assert processor["generated_tokens"][:len(short)] == short
    job = _job_rows(_job(tmp_path, {"max_new_tokens": 24, "min_tokens": 12}, prompt=[EARLY_EOS]))
    body = {"custom_id": "o", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": EARLY_EOS, "max_tokens": 24, "min_tokens": 12}}
    staged, _ = request_row(body, None, 1, "b.jsonl")
    (tmp_path / "oa").mkdir()
    pq.write_table(pa.Table.from_pylist([staged], schema=openai_batch.SCHEMA), tmp_path / "oa" / "staged.parquet")
    cfg = load_config(None, data={"input": {"paths": [str(tmp_path / "oa")]}, "output": {"path": str(tmp_path / "o")},
                                  "model": {"path": str(MODEL)}, "prompt": {"chat_template": "off"},
                                  "sampling": {"max_new_tokens": 24}})
    for table in (job, _job_rows(cfg)):
        (row,) = _generated(stage, table)
        _no_eos_before(row, 12, stage.eos_ids)
        assert row["generated_tokens"] == processor["generated_tokens"]     # greedy: one answer, three sources


def test_min_tokens_is_in_the_resume_fingerprint_only_when_set(tmp_path):
    from pipeline.run.fingerprint import fingerprint

    assert "sampling.min_tokens" not in fingerprint(_job(tmp_path, {}, prompt=["a"]))    # older outputs resume
    assert fingerprint(_job(tmp_path, {"min_tokens": 3}, prompt=["a"]))["sampling.min_tokens"] == 3


@pytest.fixture
def builds(monkeypatch):
    """How many SamplingParams have been built (each build validates every field) since the test began."""
    count = {"n": 0}
    original = SamplingParams.__post_init__

    def counting(self):
        count["n"] += 1
        original(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", counting)
    return count


def test_each_setting_is_built_once_from_job_rows_to_the_actor(tmp_path, builds):
    """The job: 30 rows x 2 samples with 3 distinct override settings (one bad) are built 3 times in
    preprocessing (not once per row, nor again in the prepare step) and decoded once per distinct
    setting by the actor; every sample keeps its own seed."""
    temps = [None, 0.5, -1.0] * 10
    cfg = _job(tmp_path, {"n": 2, "seed": 3}, prompt=[f"p{i}" for i in range(30)], temperature=temps)
    rows = _job_rows(cfg)
    assert builds["n"] == 3
    errors = rows["error"].to_pylist()
    assert errors.count(None) == 40 and set(errors) - {None} == {
        "column 'temperature' must be a finite number >= 0, got -1.0"}
    seeds = rows["seed"].to_pylist()
    assert len({s for s, e in zip(seeds, errors) if e is None}) == 40          # one seed per sample
    requests = read_requests(rows[REQUEST])
    assert builds["n"] == 3 + 2                                                 # the actor: per distinct setting
    assert [p.seed for p in requests.params if p] == [s for s, e in zip(seeds, errors) if e is None]
    assert {p.temperature for p in requests.params if p} == {0.0, 0.5}


def test_each_setting_is_built_once_from_processor_rows(builds):
    """The processor: rows sharing a ``sampling_params`` value share one build; a bad seed is still
    each row's own error; unseeded rows each draw their own seed."""
    plan = PreparePlan(ModelConfig(path=str(MODEL)), StorageConfig(), ChatTemplate("off"))
    params = [{"max_tokens": 3}, {"max_tokens": 3, "seed": 1}, {"max_tokens": 3, "seed": -2}, {"max_tokens": 4},
              {"max_tokens": 3}, {"max_tokens": 3, "top_k": -1}]
    out = prepare_batch(pa.table({"prompt": ["a"] * len(params), "sampling_params": params}), plan)
    assert builds["n"] == 3          # {max_tokens 3}, {max_tokens 4}, {max_tokens 3, top_k off}
    errors = out["error"].to_pylist()
    assert errors[2].startswith("sampling_params.seed must be None or an int in [0, 2**63)")
    assert [e for i, e in enumerate(errors) if i != 2] == [None] * 5
    seeds = out["seed"].to_pylist()
    assert seeds[1] == 1 and len({seeds[0], seeds[3], seeds[4], seeds[5]}) == 4


def _openai_rows(tmp_path: Path, bodies: list[dict]) -> pa.Table:
    """OpenAI batch requests (completions) staged and preprocessed as the job does."""
    staged = [request_row({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b}, None, i + 1,
                          "b.jsonl")[0] for i, b in enumerate(bodies)]
    (tmp_path / "oa").mkdir()
    pq.write_table(pa.Table.from_pylist(staged, schema=openai_batch.SCHEMA), tmp_path / "oa" / "staged.parquet")
    return _job_rows(load_config(None, data={"input": {"paths": [str(tmp_path / "oa")]},
                                             "output": {"path": str(tmp_path / "o")}, "model": {"path": str(MODEL)},
                                             "prompt": {"chat_template": "off"}, "sampling": {"max_new_tokens": 16}}))


def test_penalties_and_logit_bias_through_the_job_the_processor_and_an_openai_batch(stage, tmp_path):
    """The options synthetic-data jobs send give rows from every source (the same greedy tokens from
    each), change what they should, and a bad value is that row's error naming the user's key."""
    plan = PreparePlan(ModelConfig(path=str(MODEL)), StorageConfig(), ChatTemplate("off"))
    prompt = "def fib(n):"
    (free,) = _generated(stage, prepare_batch(pa.table({"prompt": [prompt], "sampling_params": [{"max_tokens": 16}]}),
                                              plan))
    banned = free["generated_tokens"][0]
    options = {"frequency_penalty": 0.3, "repetition_penalty": 1.3}
    processor, bad_rep = _generated(stage, prepare_batch(pa.table({"prompt": [prompt] * 2, "sampling_params": [
        {"max_tokens": 16, **options, "logit_bias": {str(banned): -100.0}}, {"max_tokens": 16, "repetition_penalty": 0.0}]}),
        plan))
    assert processor["error"] is None and processor["generated_tokens"][0] != banned
    assert bad_rep["error"].startswith("sampling_params.repetition_penalty must be a finite number > 0")
    bias = pa.array([[(banned, -100.0)], [(banned, -100.0)]], pa.map_(pa.int64(), pa.float64()))
    job = _job_rows(_job(tmp_path, {"max_new_tokens": 16}, prompt=[prompt] * 2, frequency_penalty=[0.3, 3.0],
                         repetition_penalty=[1.3, 1.3], logit_bias=bias))
    assert job["error"].to_pylist()[1] == "column 'frequency_penalty' must be a number in [-2, 2] (0 = off), got 3.0"
    openai = _openai_rows(tmp_path, [{"prompt": prompt, "max_tokens": 16, **options, "logit_bias": {str(banned): -100}},
                                     {"prompt": prompt, "logit_bias": {"x": 1}}])
    assert openai["error"].to_pylist()[1] == "line 2 of b.jsonl: body.logit_bias key must be an integer, got 'x'"
    for table in (job.slice(0, 1), openai.slice(0, 1)):
        (row,) = _generated(stage, table)
        assert row["error"] is None and row["generated_tokens"] == processor["generated_tokens"]


def test_ignore_eos_and_min_p_from_the_config(stage, tmp_path):
    """``ignore_eos`` in the job config: a row that greedy decoding ends at EOS runs to max_new_tokens."""
    cfg = _job(tmp_path, {"max_new_tokens": 20, "ignore_eos": True, "min_p": 0.05}, prompt=[EARLY_EOS])
    (row,) = _generated(stage, _job_rows(cfg))
    assert row["error"] is None and row["num_generated_tokens"] == 20 and row["finish_reason"] == "length"
    assert stage.eos_ids.intersection(row["generated_tokens"])            # it went on past an EOS
    with pytest.raises(ConfigError, match="ignore_eos"):
        _job(tmp_path, {"ignore_eos": True, "structured": {"regex": "a"}}, prompt=["a"])
