"""The processor's config, prepare stage and generation stage, without Ray (the Ray pipeline: test_processor_ray.py)."""
from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from pipeline import OrthrusProcessorConfig, build_orthrus_processor
from pipeline.actor.stage import GenerationStage
from pipeline.config import ConfigError
from pipeline.processor.build import StageOptions, prepare_plan, stage_plan
from pipeline.requests.prepare import prepare_batch, sampling_params_of
from pipeline.requests.errors import RowError
from pipeline.requests.request import REQUEST, from_arrow


def _config(model, **kw) -> OrthrusProcessorConfig:
    return OrthrusProcessorConfig(model_source=str(model), engine_kwargs={"max_batch_size": 2, "dtype": "float32"}, **kw)


@pytest.mark.parametrize("bad, field", [({"engine_kwargs": {"max_batch_sise": 2}}, "engine_kwargs.max_batch_sise"),
                                        ({"concurrency": (3, 1)}, "concurrency"), ({"batch_size": 0}, "batch_size"),
                                        ({"engine_kwargs": {"speculative": "maybe"}}, "engine_kwargs.speculative"),
                                        ({"tokenise": False}, "tokenise")])
def test_a_bad_config_names_the_field(bad, field):
    with pytest.raises(ConfigError, match=rf"(?m)^  {field}(\.|:)"):
        build_orthrus_processor({"model_source": "m", **bad})


def test_sampling_params_take_vllms_names_from_a_struct_or_a_map():
    p = sampling_params_of({"temperature": 0.5, "top_k": -1, "max_tokens": 7.0, "seed": 3, "stop": "\n",
                            "stop_token_ids": [5], "logprobs": 2, "top_p": None})
    assert (p.temperature, p.top_k, p.max_new_tokens, p.seed, p.stop, p.stop_token_ids, p.logprobs) == \
        (0.5, 0, 7, 3, ("\n",), (5,), 2)
    assert sampling_params_of([("max_tokens", 3)]).max_new_tokens == 3          # a map column's value
    unseeded = {sampling_params_of(None).seed for _ in range(4)}
    assert len(unseeded) == 4                                                   # random, and reported
    for bad, message in (({"presence_penalty": 3.0}, r"sampling_params.presence_penalty must be a number in \[-2, 2\]"),
                         ({"logit_bias": {"7": 200}}, r"sampling_params.logit_bias values must be numbers in \[-100, 100\]"),
                         ({"best_of": 2}, "sampling_params.best_of: not supported"),
                         ({"max_tokens": 0.5}, "sampling_params.max_tokens must be an integer"),
                         ({"temperature": "hot"}, "sampling_params.temperature must be a number"),
                         ({"logprobs": 99}, r"sampling_params.logprobs must be None or an int in \[0, 20\]"), ("x", "must be a struct or map")):
        with pytest.raises(RowError, match=message):
            sampling_params_of(bad)


def test_prepare_and_generate_rows_in_the_processors_shape(tiny_orthrus_dir):
    cfg = _config(tiny_orthrus_dir, apply_chat_template=False)
    batch = pa.table({"prompt": ["def f(x):", "def g():", None, "x"],
                      "sampling_params": [{"max_tokens": 4, "logprobs": 0}, {"max_tokens": 3}, {"max_tokens": 3},
                                          {"max_tokens": 3}],
                      "error": [None, None, None, "marked bad upstream"], "tag": ["a", "b", "c", "d"]})
    prepared = prepare_batch(batch, prepare_plan(cfg))
    requests = from_arrow(prepared[REQUEST])
    assert [r is not None for r in requests] == [True, True, False, False]
    assert prepared["prompt"].to_pylist() == batch["prompt"].to_pylist()        # inputs pass through
    stage = GenerationStage(stage_plan(cfg, StageOptions()))
    rows = asyncio.run(stage(prepared)).to_pylist()
    assert [r["tag"] for r in rows] == ["a", "b", "c", "d"] and "__batch" not in rows[0]
    assert rows[0]["num_generated_tokens"] == len(rows[0]["generated_tokens"]) == len(rows[0]["token_logprobs"])
    assert rows[0]["top_logprobs"] is None and rows[1]["token_logprobs"] is None and rows[0]["generated_text"]
    assert rows[2]["finish_reason"] == "error" and "prompt is missing" in rows[2]["error"]
    assert rows[3]["error"] == "marked bad upstream" and rows[3]["generated_text"] is None


def test_pretokenized_rows_and_no_detokenization(tiny_orthrus_dir):
    cfg = _config(tiny_orthrus_dir, tokenize=False, detokenize=False)
    batch = pa.table({"tokenized_prompt": pa.array([[1, 2, 3], [], None], pa.list_(pa.int64())),
                      "sampling_params": [{"max_tokens": 2, "seed": 1}] * 3})
    prepared = prepare_batch(batch, prepare_plan(cfg))
    assert from_arrow(prepared[REQUEST])[0][0] == [1, 2, 3] and prepared["num_input_tokens"].to_pylist()[0] == 3
    rows = asyncio.run(GenerationStage(stage_plan(cfg, StageOptions()))(prepared)).to_pylist()
    assert rows[0]["generated_text"] is None and len(rows[0]["generated_tokens"]) == 2 and rows[0]["seed"] == 1
    assert [r["finish_reason"] for r in rows[1:]] == ["error", "error"]
    assert "tokenized_prompt must be a non-empty list" in rows[1]["error"]
