"""Structured output end to end on a local Ray: the job over Parquet rows that each carry their own
constraint (every case of ``jobs/structured_suite.py``, greedy and seeded), and over OpenAI-batch
requests with ``response_format`` / ``guided_*``. Every row that ends "stop" must satisfy its
constraint as checked by tools that know nothing of the grammar engine; bad constraints are their
rows' errors, never the job's (rows in == rows out)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from jobs.structured_suite import SUITE, valid
from support.paths import TOKENIZER_DIR

MODEL = TOKENIZER_DIR   # trained: it finishes records
PROMPTS = ("def parse(record):", "# the answer, as asked:")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
          "additionalProperties": False}
ENGINE = {"max_batch_size": 8, "batch_size": 16, "dtype": "float32"}


def _run(tmp_path: Path, name: str, cfg: dict) -> Path:
    from jobs.generate import main

    cfg = {"output": {"path": str(tmp_path / name)}, "model": {"path": str(MODEL)}, "engine": ENGINE, **cfg}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / f"{name}.yaml")]) == 0
    return tmp_path / name


def _rows() -> list[dict]:
    """Each suite case on every prompt (greedy, then seeded sampling), rows without a constraint,
    and three bad rows."""
    rows = [{"id": f"{case.name}/{j}", "case": case.name, "prompt": prompt, "structured": json.dumps(case.structured),
             "temperature": 0.0 if j == 0 else 0.8, "seed": None if j == 0 else 100 + i}
            for i, case in enumerate(SUITE) for j, prompt in enumerate(PROMPTS)]
    rows += [{"id": f"free/{j}", "prompt": p, "structured": "null" if j else None, "stop": ["\n"]}
             for j, p in enumerate(PROMPTS * 2)]
    rows += [{"id": "bad/regex", "prompt": "x", "structured": json.dumps({"regex": "[0-9"})},
             {"id": "bad/schema", "prompt": "x", "structured": json.dumps({"json_schema": {"type": "objekt"}})},
             {"id": "bad/stop", "prompt": "x", "structured": json.dumps({"regex": "[a-z]+"}), "stop": ["\n"]}]
    return rows


def test_every_suite_constraint_through_the_job(ray_local, tmp_path):
    rows = _rows()
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("id", pa.string()), ("case", pa.string()), ("prompt", pa.string()), ("structured", pa.string()),
        ("temperature", pa.float64()), ("seed", pa.int64()), ("stop", pa.list_(pa.string()))])),
        tmp_path / "in" / "rows.parquet")
    out = _run(tmp_path, "out", {"input": {"paths": [str(tmp_path / "in")]}, "prompt": {"chat_template": "off"},
                                 "sampling": {"max_new_tokens": 64}})
    got = {r["id"]: r for r in pq.read_table(out / "data").to_pylist()}
    assert len(got) == len(rows) and set(got) == {r["id"] for r in rows}          # rows in == rows out

    assert got["bad/regex"]["error"].startswith("column 'structured': regex does not compile")
    assert got["bad/schema"]["error"].startswith("column 'structured': json_schema does not compile")
    assert got["bad/stop"]["error"].startswith("column 'structured' cannot be combined with column 'stop'")
    cases = {c.name: c for c in SUITE}
    finished = Counter()
    for r in got.values():
        if r["id"].startswith("bad/"):
            assert r["finish_reason"] == "error"
            continue
        assert r["error"] is None and r["finish_reason"] in ("stop", "length"), r
        if r["case"] is None:
            continue
        finished[r["finish_reason"]] += 1
        if r["finish_reason"] == "stop":
            assert valid(cases[r["case"]], r["completion"]), (r["id"], r["completion"])
    print(f"constrained rows: {dict(finished)}")        # "length": cut by max_new_tokens, allowed
    assert finished["stop"] >= 2 * len(SUITE) * 0.6      # the trained model finishes most records


def test_openai_batch_response_format_and_guided_keys(ray_local, tmp_path):
    def request(custom_id: str, **body) -> str:
        body = {"messages": [{"role": "user", "content": "def person():"}], "max_tokens": 48, "seed": 1, **body}
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})

    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    lines = [request("schema", response_format=schema), request("schema-hot", response_format=schema, temperature=0.8),
             request("object", response_format={"type": "json_object"}),
             request("text", response_format={"type": "text"}),
             request("regex", guided_regex="[a-z]{2,8}"), request("choice", guided_choice=["yes", "no"]),
             request("bad-schema", response_format={"type": "json_schema",
                                                    "json_schema": {"schema": {"type": "objekt"}}}),
             request("bad-regex", guided_regex="(unclosed"), request("two", guided_regex="a", guided_choice=["a"])]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "requests.jsonl").write_text("\n".join(lines) + "\n")
    out = _run(tmp_path, "batch", {"input": {"paths": [str(tmp_path / "in")], "format": "openai_batch"}})
    results = {r["custom_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    errors = {r["custom_id"]: r["error"]["message"]
              for r in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    assert set(results) | set(errors) == {json.loads(line)["custom_id"] for line in lines}
    assert set(errors) == {"bad-schema", "bad-regex", "two"}
    assert errors["bad-schema"].startswith("body.response_format.json_schema.schema: json_schema does not compile")
    assert errors["bad-regex"].startswith("body.guided_regex: regex does not compile")
    assert "body.guided_regex and body.guided_choice both ask" in errors["two"]
    text = {k: (r["response"]["body"]["choices"][0]["message"]["content"],
                r["response"]["body"]["choices"][0]["finish_reason"]) for k, r in results.items()}
    import jsonschema

    for key, check in (("schema", lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
                       ("schema-hot", lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
                       ("object", lambda t: isinstance(json.loads(t), dict)),
                       ("regex", lambda t: t.isalpha() and t.islower() and 2 <= len(t) <= 8),
                       ("choice", lambda t: t in ("yes", "no"))):
        content, reason = text[key]
        assert reason == "length" or check(content), (key, content)
    print(text)
    assert text["choice"][1] == "stop"
