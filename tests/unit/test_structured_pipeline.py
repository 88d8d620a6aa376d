"""Structured output through the job and the processor, without Ray: config and preflight, OpenAI
``response_format``/``guided_*`` and vLLM ``sampling_params`` mapping, per-row overrides, conflicts
with stops, compile errors as row errors naming their field (the Ray run: test_structured_ray.py)."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orthrus import Constraint, SamplingParams
from pipeline.config import ConfigError, ModelConfig, StorageConfig
from pipeline.config_file import load_config
from pipeline.requests.prepare import PreparePlan, prepare_batch, sampling_params_of
from pipeline.inputs.json_lines import infer
from pipeline.inputs.openai_batch import request_row
from pipeline.requests.errors import RowError
from pipeline.requests.prompts import ChatTemplate
from pipeline.requests.request import REQUEST, REQUEST_TYPE, from_arrow, to_arrow
from pipeline.requests.structured import STAGED_STRUCTURED, STRUCTURED_FIELD
from pipeline.run.fingerprint import fingerprint
from pipeline.run.job import preflight
from support.job_inputs import preprocess_rows
from support.paths import TOKENIZER_DIR

MODEL = TOKENIZER_DIR
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _job(tmp_path: Path, sampling: dict | None = None, **columns):
    (tmp_path / "in").mkdir(exist_ok=True)
    if columns:
        pq.write_table(pa.table(columns), tmp_path / "in" / "rows.parquet")
    return load_config(None, data={"input": {"paths": [str(tmp_path / "in")]},
                                   "output": {"path": str(tmp_path / "out")}, "model": {"path": str(MODEL)},
                                   "sampling": sampling or {}})


# ---------------------------------------------------------------- config and preflight

@pytest.mark.parametrize("bad, message", [
    ({"regex": "a", "choice": ["b"]}, "exactly one of"), ({"jsonschema": {}}, "exactly one of"),
    ("a+", "valid dictionary"), ({"choice": []}, "structured.choice must be a non-empty list"),
    ({"json_schema": "{oops"}, "structured.json_schema is not valid JSON")])
def test_a_bad_shape_fails_config_validation_naming_the_field(tmp_path, bad, message):
    with pytest.raises(ConfigError, match=r"(?m)^  sampling\.structured: .*" + message):
        _job(tmp_path, {"structured": bad})


def test_structured_with_stops_is_refused_and_is_part_of_the_resume_fingerprint(tmp_path):
    for stops in ({"stop": ["\n"]}, {"stop_token_ids": [3]}):
        with pytest.raises(ConfigError, match="structured cannot be combined with stop"):
            _job(tmp_path, {"structured": {"regex": "[a-z]+"}, **stops})
    cfg = _job(tmp_path, {"structured": {"json_schema": PERSON}})
    assert fingerprint(cfg)["sampling.structured"] == {"json_schema": PERSON}
    assert fingerprint(_job(tmp_path))["sampling.structured"] is None     # a change is named on --resume


@pytest.mark.parametrize("structured, kind", [({"regex": "[a-"}, "regex"), ({"grammar": "start: nowhere"}, "grammar"),
                                              ({"json_schema": {"type": "objekt"}}, "json_schema")])
def test_a_constraint_that_does_not_compile_fails_preflight(tmp_path, structured, kind):
    cfg = _job(tmp_path, {"structured": structured}, prompt=["p"])
    with pytest.raises(ConfigError, match=rf"^sampling\.structured: structured\.{kind} does not compile"):
        preflight(cfg)
    assert not (tmp_path / "out").exists()                  # before anything is written or loaded
    preflight(_job(tmp_path, {"structured": {"regex": "[a-z]+"}}))


# ---------------------------------------------------------------- OpenAI batch bodies

def _staged(**body) -> dict:
    obj = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "hi"}], **body}}
    return request_row(obj, None, 1, "b.jsonl")[0]


def test_openai_response_format_and_guided_keys_become_the_rows_constraint():
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    cases = [({"response_format": schema}, {"json_schema": PERSON}, "body.response_format.json_schema.schema"),
             ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}},
              "body.response_format"),
             ({"response_format": {"type": "text"}}, None, "body.response_format"),
             ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}, "body.guided_regex"),
             ({"guided_json": json.dumps(PERSON)}, {"json_schema": PERSON}, "body.guided_json"),
             ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}, "body.guided_choice"),
             ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}, "body.guided_grammar"),
             ({"response_format": {"type": "text"}, "guided_regex": "x"}, {"regex": "x"}, "body.guided_regex")]
    for body, expected, field in cases:
        row = _staged(**body)
        assert json.loads(row[STAGED_STRUCTURED]) == expected and row[STRUCTURED_FIELD] == field, body
    assert STAGED_STRUCTURED not in _staged(temperature=0.5)


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "a", "guided_json": PERSON}, "body.guided_json and body.guided_regex both ask"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "body.response_format and body.guided"),
    ({"response_format": {"type": "yaml"}}, "body.response_format.type must be 'text', 'json_object' or"),
    ({"response_format": "json"}, "body.response_format must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "body.response_format.json_schema.schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "body.response_format.json_schema.schema: .*must be a JSON schema"),
    ({"guided_choice": []}, "body.guided_choice: .*non-empty list"),
    ({"guided_regex": "x", "stop": ["\n"]}, "body.guided_regex cannot be combined with body.stop")])
def test_a_bad_openai_constraint_is_that_lines_error(body, message):
    row = _staged(**body)
    assert set(row) == {"id", "__input_error"}
    assert row["__input_error"].startswith("line 1 of b.jsonl: ")
    assert re.search(message, row["__input_error"]), row["__input_error"]


# ---------------------------------------------------------------- the processor's sampling_params

def test_vllm_guided_names_map_to_the_engines_constraint():
    c = lambda p: p.structured.as_dict() if p.structured else None  # noqa: E731
    assert c(sampling_params_of({"structured": {"regex": "[a-z]+"}})) == {"regex": "[a-z]+"}
    assert c(sampling_params_of({"structured": json.dumps({"choice": ["x", "y"]})})) == {"choice": ["x", "y"]}
    assert c(sampling_params_of({"structured": "null"})) is None
    assert c(sampling_params_of({"guided_decoding": {"json": PERSON}})) == {"json_schema": PERSON}
    assert c(sampling_params_of({"structured_outputs": {"json_object": True}})) == {"json_schema": {"type": "object"}}
    assert c(sampling_params_of({"guided_json": json.dumps(PERSON)})) == {"json_schema": PERSON}
    assert c(sampling_params_of({"guided_grammar": 'root ::= "a"', "max_tokens": 3})) == {"grammar": 'root ::= "a"'}
    # As Ray Data hands them over: a struct column has every row's fields, the unused ones null.
    struct = {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": None}},
                       "required": ["name"], "enum": None}, "regex": None, "choice": None, "grammar": None,
              "backend": "xgrammar"}
    assert c(sampling_params_of({"guided_decoding": struct, "guided_regex": None})) == {
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}
    assert c(sampling_params_of([("guided_regex", "a+")])) == {"regex": "a+"}       # a map column


@pytest.mark.parametrize("params, message", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "sampling_params.guided_regex and sampling_params.guided_choice"),
    ({"structured": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "sampling_params.structured and"),
    ({"guided_decoding": {"regex": "a", "json": {}}}, "guided_decoding must set exactly one of"),
    ({"guided_decoding": {"structural_tag": "x"}}, "guided_decoding.structural_tag is not supported"),
    ({"structured": {"regexp": "a"}}, r"sampling_params.structured: SamplingParams.structured must be a dict"),
    ({"structured": "{nope"}, "sampling_params.structured is not valid JSON"),
    ({"guided_regex": "a", "stop": "\n"}, "sampling_params.guided_regex cannot be combined with sampling_params.stop"),
    ({"guided_choice": ["a"], "stop_token_ids": [1]}, "cannot be combined with sampling_params.stop_token_ids")])
def test_bad_or_conflicting_sampling_params_are_the_rows_error(params, message):
    with pytest.raises(RowError, match=message):
        sampling_params_of(params)


def test_prepare_compiles_each_constraint_and_names_the_field_that_fails():
    plan = PreparePlan(ModelConfig(path=str(MODEL)), StorageConfig(), ChatTemplate("off", None, ()))
    params = [{"guided_regex": "[0-9]{3}"}, {"guided_regex": "[0-"}, {"guided_decoding": {"json": {"type": "objekt"}}},
              {"structured": {"grammar": "start: nowhere"}}, {"max_tokens": 2}, {"guided_regex": "[0-9]{3}"}]
    # As Ray Data builds the column from a preprocess's dicts: one struct, every row's keys, nulls.
    out = prepare_batch(pa.table({"prompt": ["a"] * 6, "sampling_params": params}), plan)
    errors = out["error"].to_pylist()
    assert errors[0] is None and errors[4] is None and errors[5] is None
    assert errors[1].startswith("sampling_params.guided_regex: regex does not compile: ")
    assert errors[2].startswith("sampling_params.guided_decoding.json: json_schema does not compile: Invalid type")
    assert errors[3].startswith("sampling_params.structured: grammar does not compile: ")
    requests = from_arrow(out[REQUEST])
    assert requests[0][1].structured == Constraint("regex", "[0-9]{3}") and requests[4][1].structured is None
    assert [r is None for r in requests] == [False, True, True, True, False, False]


def test_whatever_the_compiler_raises_is_a_message_and_each_constraint_compiles_once():
    from transformers import AutoTokenizer

    from pipeline.requests.structured import _compiles, compile_error

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    bad = Constraint("json_schema", "true")     # refused outside the matcher (by the schema converter)
    assert compile_error(tokenizer, bad, "column 'structured'").startswith(
        "column 'structured': json_schema does not compile: ")
    before = _compiles.cache_info().hits
    assert compile_error(tokenizer, Constraint("regex", "[a-z]{4}"), "x") is None
    assert compile_error(tokenizer, Constraint("regex", "[a-z]{4}"), "y") is None
    assert _compiles.cache_info().hits == before + 1


def test_the_request_column_round_trips_a_constraint():
    params = [SamplingParams(structured={"json_schema": PERSON}), SamplingParams(structured={"choice": ['a "q"', "b"]}),
              SamplingParams(structured={"grammar": 'root ::= "x"'}), SamplingParams()]
    back = from_arrow(to_arrow([([1, 2], p) for p in params]))
    assert [b[1] for b in back] == params


# ---------------------------------------------------------------- the job's rows

def _constraint(row: dict) -> dict | None:
    request = from_arrow(pa.array([row[REQUEST]], REQUEST_TYPE))[0]
    return None if request is None or request[1].structured is None else request[1].structured.as_dict()


def test_a_rows_structured_column_overrides_the_jobs(tmp_path):
    cells = [None, json.dumps({"regex": "[0-9]+"}), "null", json.dumps({"regex": "[0-"}), json.dumps({"regexp": "x"}),
             json.dumps({"choice": ["a"]}), json.dumps(json.dumps({"choice": ["b"]}))]
    stop = pa.array([None, None, None, None, None, ["\n"], None], pa.list_(pa.string()))
    cfg = _job(tmp_path, {"structured": {"json_schema": PERSON}, "max_new_tokens": 4}, prompt=["p"] * 7,
               structured=cells, stop=stop, id=[f"r{i}" for i in range(7)])
    rows = {r["id"]: r for r in preprocess_rows(cfg)}
    assert _constraint(rows["r0"]) == {"json_schema": PERSON}             # the job's default
    assert _constraint(rows["r1"]) == {"regex": "[0-9]+"}                 # the row's own
    assert _constraint(rows["r2"]) is None and rows["r2"]["error"] is None  # JSON null: off for this row
    assert rows["r3"]["error"].startswith("column 'structured': regex does not compile")
    assert rows["r4"]["error"].startswith("column 'structured': SamplingParams.structured must be a dict")
    assert rows["r5"]["error"].startswith("column 'structured' cannot be combined with column 'stop'")
    assert _constraint(rows["r6"]) == {"choice": ["b"]}                   # JSON text staged as JSON text
    assert "structured" not in rows["r0"] and STRUCTURED_FIELD not in rows["r0"]   # consumed


def test_a_struct_column_and_job_level_stops(tmp_path):
    cells = pa.array([{"regex": "[a-z]+", "choice": None}, {"regex": None, "choice": ["x", "y"]}, None],
                     pa.struct([("regex", pa.string()), ("choice", pa.list_(pa.string()))]))
    rows = preprocess_rows(_job(tmp_path, {"max_new_tokens": 4}, prompt=["p"] * 3, structured=cells))
    assert [_constraint(r) for r in rows] == [{"regex": "[a-z]+"}, {"choice": ["x", "y"]}, None]
    rows = preprocess_rows(_job(tmp_path, {"stop_token_ids": [5]}, prompt=["p"] * 3, structured=cells))
    assert rows[0]["error"].startswith("column 'structured' cannot be combined with sampling.stop_token_ids")
    assert rows[2]["error"] is None                       # no constraint: the stops apply as before


def test_a_jsonl_structured_key_is_staged_as_exact_json_text():
    chunk = [(1, {"structured": {"json_schema": PERSON}}, None), (2, {"structured": {"regex": "a"}}, None)]
    types, _ = infer(iter([chunk]), "id")
    assert types["structured"] is None                    # JSON text, not a struct merging both rows


def test_an_openai_row_error_names_the_body_field(tmp_path):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    rows = [_staged(response_format=bad), _staged(guided_regex="[0-9]{2}")]
    table = pa.Table.from_pylist([{**r, "id": f"o{i}"} for i, r in enumerate(rows)])
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "staged.parquet")
    out = {r["id"]: r for r in preprocess_rows(_job(tmp_path, {"max_new_tokens": 4, "stop": ["\n"]}))}
    assert out["o0"]["error"].startswith("body.response_format.json_schema.schema cannot be combined with "
                                         "sampling.stop")
    out = {r["id"]: r for r in preprocess_rows(_job(tmp_path, {"max_new_tokens": 4}))}
    assert out["o0"]["error"].startswith("body.response_format.json_schema.schema: json_schema does not compile")
    assert _constraint(out["o1"]) == {"regex": "[0-9]{2}"}


# ---------------------------------------------------------------- the actor

def test_a_constraint_refused_by_the_engine_is_an_error_row(tiny_orthrus_dir):
    from pipeline.actor.stage import GenerationStage, StagePlan
    from pipeline.config import EngineKwargs

    stage = GenerationStage(StagePlan(ModelConfig(path=str(tiny_orthrus_dir)),
                                      EngineKwargs(max_batch_size=2, dtype="float32"), use_gpu=False))
    requests = [([1, 2, 3], SamplingParams(max_new_tokens=6, structured={"regex": "[0-"})),
                ([1, 2, 3], SamplingParams(max_new_tokens=12, structured={"choice": ["yes", "no"]})),
                ([1, 2, 3], SamplingParams(max_new_tokens=4, seed=1, temperature=1.0))]
    rows = asyncio.run(stage(pa.table({REQUEST: to_arrow(requests)}))).to_pylist()
    assert rows[0]["finish_reason"] == "error"
    assert rows[0]["error"].startswith("invalid request: SamplingParams.structured.regex does not compile")
    assert rows[1]["finish_reason"] == "stop" and rows[1]["generated_text"] in ("yes", "no")
    assert rows[2]["finish_reason"] in ("stop", "length") and rows[2]["error"] is None
