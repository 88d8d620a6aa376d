"""JSONL and OpenAI-batch inputs staged into Parquet (``pipeline/inputs/staging.py``), without Ray:
``stage`` runs its conversions inline when Ray is not initialised."""
from __future__ import annotations

import gzip
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import BehaviourConfig, ConfigError, InputConfig, StorageConfig
from pipeline.output.directory import STAGED_DIR, OutputDir
from pipeline.inputs.plan import INPUT_ERROR, inspect_inputs, resolve_files
from pipeline.inputs.json_lines import JSON_SUFFIXES
from pipeline.inputs.openai_batch import SCHEMA as OPENAI_SCHEMA
from pipeline.inputs.staging import STAGED_KEY, input_format, sniff_sources, stage
from pipeline.requests.errors import FORMAT
from support.job_inputs import job_config, preprocess_rows, write_shard
from support.paths import TOKENIZER_DIR

STORAGE = StorageConfig()


def _lines(rows: list) -> bytes:
    """JSONL bytes: dicts are dumped, bytes and str go in as they are (malformed lines, blanks)."""
    out = []
    for r in rows:
        out.append(r if isinstance(r, bytes) else r.encode() if isinstance(r, str) else json.dumps(r).encode())
    return b"\n".join(out) + b"\n"


def _write(path, rows: list, codec: str | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _lines(rows)
    if codec == "gzip":
        path.write_bytes(gzip.compress(data))
    elif codec == "zstd":
        with pa.CompressedOutputStream(pa.OSFile(str(path), "wb"), "zstd") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return str(path)


def _stage(tmp_path, paths: list[str], fmt: str = "auto", **cfg) -> tuple[InputConfig, OutputDir]:
    cfg = InputConfig(paths=paths, format=fmt, **cfg)
    sources = sniff_sources(cfg, STORAGE, input_format(cfg, STORAGE))
    out = OutputDir(str(tmp_path / "out"))
    out.store.make_dirs("data")
    return stage(sources, cfg, out), out


def _rows(path: str) -> list[dict]:
    return pq.read_table(path).to_pylist()


# ---------------------------------------------------------------- jsonl

def test_plain_gz_and_zst_jsonl_stage_to_parquet_with_inferred_types(tmp_path):
    src = tmp_path / "in"
    _write(src / "a.jsonl", [{"id": 1, "prompt": "p1", "n": 1, "x": 1.5, "meta": {"k": 1}, "tags": ["a"]},
                             "", {"id": "two", "prompt": "p2", "n": 2, "x": 2, "meta": {"j": "v"}, "mixed": {"o": 1}},
                             {"id": 3, "prompt": "p3", "mixed": 7, "empty": {}}])
    _write(src / "b.jsonl.gz", [{"prompt": "g1"}, "   ", {"prompt": "g2"}], "gzip")
    _write(src / "c.ndjson.zst", [{"uid": "z1", "messages": [{"role": "user", "content": "hi"}]}], "zstd")
    new, out = _stage(tmp_path, [str(src)])
    assert new.format == "parquet" and len(new.paths) == 3
    assert all(p.startswith(out.store.path(STAGED_DIR) + "/") and p.endswith(".parquet") for p in new.paths)
    a, b, c = sorted(new.paths)
    assert os.path.basename(a).startswith("a.jsonl-") and len(os.path.basename(a)) == len("a.jsonl-12345678.parquet")

    schema = pq.read_schema(a)
    assert schema.names == ["id", "prompt", "n", "x", "meta", "tags", "mixed", "empty", INPUT_ERROR]
    assert schema.field("id").type == pa.string() and schema.field("n").type == pa.int64()
    assert schema.field("x").type == pa.float64() and schema.field("tags").type == pa.list_(pa.string())
    assert schema.field("meta").type == pa.struct([("k", pa.int64()), ("j", pa.string())])
    assert schema.field("mixed").type == pa.string() and schema.field("empty").type == pa.string()  # JSON text
    rows = _rows(a)
    assert [r["id"] for r in rows] == ["1", "two", "3"] and [r["x"] for r in rows] == [1.5, 2.0, None]
    assert [r["mixed"] for r in rows] == [None, '{"o": 1}', "7"] and rows[2]["empty"] == "{}"
    assert all(r[INPUT_ERROR] is None for r in rows)

    # No line has an id: '<file name>:<physical line>' (blank lines count), and no error.
    assert _rows(b) == [{"id": "b.jsonl.gz:1", "prompt": "g1", INPUT_ERROR: None},
                        {"id": "b.jsonl.gz:3", "prompt": "g2", INPUT_ERROR: None}]
    assert _rows(c)[0]["messages"] == [{"role": "user", "content": "hi"}] and _rows(c)[0]["id"] == "c.ndjson.zst:1"
    assert pq.ParquetFile(a).metadata.num_row_groups == 1

    plan = inspect_inputs(new, STORAGE)
    assert plan.input_error and INPUT_ERROR not in plan.passthrough and plan.num_rows == 6
    assert plan.id_column == "id" and plan.prompt_column == "prompt" and plan.messages_column == "messages"


def test_malformed_jsonl_lines_become_error_rows_naming_the_line(tmp_path):
    path = _write(tmp_path / "in" / "data.jsonl", [
        {"id": "a", "prompt": "ok", "t": 0.5},
        '{"id": "b", "prompt": "x" "t": 1}',            # line 2: bad JSON
        "[1, 2]",                                       # 3: not an object
        b'{"id": "c", "prompt": "\xff"}',               # 4: invalid UTF-8
        '{"id": "d", "prompt": "\\ud800"}',             # 5: a lone surrogate
        '{"id": "e", "prompt": "p", "t": 123456789012345678901234567890}',   # 6: beyond int64
        "",                                             # 7: blank
        {"prompt": "no id"},                            # 8: lacks the id others have
        {"id": {"x": 1}, "prompt": "p"},                # 9: id of the wrong kind
        {"id": "f", "prompt": "p", INPUT_ERROR: "mine"},   # 10: the reserved key (its id stays)
        {"id": 7, "prompt": "last", "t": 2},
    ])
    new, _ = _stage(tmp_path, [path], "jsonl")
    rows = _rows(new.paths[0])
    assert [r["id"] for r in rows] == ["a", "data.jsonl:2", "data.jsonl:3", "data.jsonl:4", "data.jsonl:5",
                                       "data.jsonl:6", "data.jsonl:8", "data.jsonl:9", "f", "7"]
    errors = [r[INPUT_ERROR] for r in rows]
    assert errors[0] is None and errors[-1] is None
    assert errors[1].startswith("line 2 of data.jsonl: not valid JSON: Expecting ',' delimiter")
    assert errors[2] == "line 3 of data.jsonl: not a JSON object but an array"
    assert errors[3].startswith("line 4 of data.jsonl: not valid UTF-8")
    assert errors[4].startswith("line 5 of data.jsonl: a string holds a lone surrogate")
    assert errors[5] == "line 6 of data.jsonl: an integer does not fit in 64 bits"
    assert errors[6] == "line 8 of data.jsonl: no 'id' (input.id_column), which other lines have"
    assert errors[7].startswith("line 9 of data.jsonl: 'id' (input.id_column) must be a string or an integer")
    assert "reserved" in errors[8]
    for r in rows[1:-1]:                              # error rows: only id and error
        assert r["prompt"] is None and r["t"] is None
    assert pq.read_schema(new.paths[0]).field("t").type == pa.float64()


def test_a_value_that_does_not_fit_the_files_type_fails_only_its_line(tmp_path):
    big = 2 ** 53 + 1                                 # int64 in its own chunk, but not exactly a double
    rows = [{"id": "big", "prompt": "p", "v": big}] + [{"id": f"r{i}", "prompt": "p", "v": i} for i in range(8191)]
    rows += [{"id": "half", "prompt": "p", "v": 0.5}]   # the next chunk makes the column double
    new, _ = _stage(tmp_path, [_write(tmp_path / "in" / "f.jsonl", rows)])
    table = pq.read_table(new.paths[0])
    assert table.num_rows == 8193 and table.schema.field("v").type == pa.float64()
    assert pq.ParquetFile(new.paths[0]).metadata.num_row_groups == 2        # row groups of 8192 rows
    bad = table.filter(pa.compute.is_valid(table[INPUT_ERROR])).to_pylist()
    assert [r["id"] for r in bad] == ["f.jsonl:1"] and "does not fit its column's type double" in bad[0][INPUT_ERROR]


def test_an_empty_jsonl_file_stages_to_zero_rows(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.jsonl").write_bytes(b"")
    full = _write(tmp_path / "in" / "full.jsonl", [{"id": "a", "prompt": "p"}])
    new, _ = _stage(tmp_path, [str(tmp_path / "in")])
    empty = next(p for p in new.paths if "empty.jsonl" in p)
    assert pq.read_table(empty).num_rows == 0 and pq.read_schema(empty).names == ["id", INPUT_ERROR]
    assert inspect_inputs(new, STORAGE).file_rows == (0, 1) and full


def test_a_source_name_with_glob_characters_stages_to_a_plain_name(tmp_path):
    path = _write(tmp_path / "in" / "data[1] *.jsonl", [{"id": "a", "prompt": "p"}])
    new, _ = _stage(tmp_path, [str(tmp_path / "in")])
    assert os.path.basename(new.paths[0]).startswith("data_1___.jsonl-")
    assert inspect_inputs(new, STORAGE).files == tuple(new.paths)
    assert _rows(new.paths[0])[0]["id"] == "a" and path


def test_two_sources_of_one_name_needing_made_up_ids_are_refused(tmp_path):
    one = _write(tmp_path / "x" / "data.jsonl", [{"prompt": "a"}])
    two = _write(tmp_path / "y" / "data.jsonl", [{"prompt": "b"}])
    with pytest.raises(ConfigError, match="both named 'data.jsonl'") as e:
        _stage(tmp_path, [one, two], "jsonl")
    assert one in str(e.value) and two in str(e.value)
    ids = _write(tmp_path / "z" / "data.jsonl", [{"id": "c", "prompt": "c"}])
    new, _ = _stage(tmp_path, [one, ids], "jsonl")     # one of them has its own ids: no clash
    assert len(new.paths) == 2 and len(set(new.paths)) == 2


# ---------------------------------------------------------------- openai batch

def _request(custom_id, url="/v1/chat/completions", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_batch_requests_become_fixed_columns_and_error_rows(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    path = _write(tmp_path / "in" / "batch.jsonl", [
        _request("c1", model="m", messages=chat, max_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop="##",
                 logprobs=True, top_logprobs=2),
        "",
        _request("c2", "/v1/completions", prompt="def f():", max_completion_tokens=9, max_tokens=1, top_k=-1,
                 stop=["a", "b"], logprobs=4, temperature=1),
        _request("c3", messages=parts, logprobs=True),
        '{"custom_id": "c4", "method": ',                                        # 5: bad JSON
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},    # 6: no custom_id
        _request("c7", messages=chat, n=2),
        _request("c8", "/v1/embeddings", input="x"),
        _request("c9", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        {**_request("c10", messages=chat), "method": "GET"},
        _request("c11", messages=chat, temperature="hot"),
        _request("c12", "/v1/completions", prompt=["a", "b"]),
        _request("c13", messages=chat, n=1, logprobs=False, top_logprobs=3, user="u"),
    ])
    new, _ = _stage(tmp_path, [path], "openai_batch")
    assert (new.id_column, new.prompt_column, new.messages_column) == ("id", "prompt", "messages")
    assert new.format == "parquet"
    assert pq.read_schema(new.paths[0]).remove_metadata() == OPENAI_SCHEMA
    rows = {r["id"]: r for r in _rows(new.paths[0])}
    c1, c2, c3 = rows["c1"], rows["c2"], rows["c3"]
    assert json.loads(c1["messages"]) == chat and c1["prompt"] is None and c1["openai_url"] == "/v1/chat/completions"
    assert (c1["max_new_tokens"], c1["temperature"], c1["top_p"], c1["seed"], c1["stop"], c1["logprobs"]) == \
        (5, 0.7, 0.9, 3, ["##"], 2)
    assert c1["top_k"] is None and c1[INPUT_ERROR] is None
    assert (c2["prompt"], c2["messages"], c2["max_new_tokens"], c2["top_k"], c2["stop"], c2["logprobs"],
            c2["temperature"]) == ("def f():", None, 9, 0, ["a", "b"], 4, 1.0)
    assert json.loads(c3["messages"]) == [{"role": "user", "content": "a\nb"}] and c3["logprobs"] == 0
    assert rows["c13"][INPUT_ERROR] is None and rows["c13"]["logprobs"] is None

    errors = {i: r[INPUT_ERROR] for i, r in rows.items() if r[INPUT_ERROR]}
    assert all(FORMAT.match(e) for e in errors.values()), errors          # the documented format (errors.py)
    assert errors["batch.jsonl:5"].startswith("line 5 of batch.jsonl: not valid JSON")
    assert errors["batch.jsonl:6"] == "line 6 of batch.jsonl: custom_id is missing"
    assert errors["c7"] == "line 7 of batch.jsonl: body.n must be 1 (n > 1 per request is not supported; set sampling.n)"
    assert errors["c8"].startswith("line 8 of batch.jsonl: url must be '/v1/chat/completions' or '/v1/completions'")
    assert "'image_url' part; only text parts are supported" in errors["c9"]
    assert errors["c10"] == "line 10 of batch.jsonl: method must be 'POST', got 'GET'"
    assert errors["c11"] == "line 11 of batch.jsonl: body.temperature must be a number, got 'hot'"
    assert errors["c12"].startswith("line 12 of batch.jsonl: body.prompt must be a string")
    assert len(errors) == 8 and len(rows) == 12
    for i in errors:                                 # error rows: id and error only
        assert all(v is None for k, v in rows[i].items() if k not in ("id", INPUT_ERROR))

    plan = inspect_inputs(new, STORAGE)
    assert plan.input_error and plan.passthrough == ("openai_url",)
    assert set(plan.override_columns) == {"temperature", "top_p", "top_k", "max_new_tokens", "min_tokens", "max_thinking_tokens", "seed", "logprobs", "stop",
                                          "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                                          "logit_bias", "ignore_eos"}


# ---------------------------------------------------------------- reuse

def test_stage_reuses_unchanged_sources_and_converts_changed_ones_again(tmp_path):
    one = _write(tmp_path / "in" / "one.jsonl", [{"id": "a", "prompt": "p"}])
    two = _write(tmp_path / "in" / "two.jsonl.gz", [{"id": "b", "prompt": "q"}], "gzip")
    new, out = _stage(tmp_path, [str(tmp_path / "in")])
    times = {p: os.stat(p).st_mtime_ns for p in new.paths}
    record = json.loads(pq.read_metadata(new.paths[0]).metadata[STAGED_KEY.encode()])
    assert record["source"] == one and record["size"] == os.path.getsize(one) and record["rows"] == 1

    again, _ = _stage(tmp_path, [str(tmp_path / "in")])
    assert again.paths == new.paths and {p: os.stat(p).st_mtime_ns for p in again.paths} == times

    _write(tmp_path / "in" / "one.jsonl", [{"id": "a", "prompt": "p"}, {"id": "c", "prompt": "r"}])
    changed, _ = _stage(tmp_path, [str(tmp_path / "in")])
    staged_one = next(p for p in changed.paths if "one.jsonl" in p)
    staged_two = next(p for p in changed.paths if "two.jsonl.gz" in p)
    assert os.stat(staged_one).st_mtime_ns != times[staged_one] and os.stat(staged_two).st_mtime_ns == times[staged_two]
    assert [r["id"] for r in _rows(staged_one)] == ["a", "c"]

    other_id, _ = _stage(tmp_path, [str(tmp_path / "in")], id_column="uid")   # another conversion rule
    assert _rows(staged_one)[0]["uid"] == "one.jsonl:1" and other_id.paths == changed.paths
    assert not os.listdir(out.tmp)                   # atomic writes left no temp files
    assert two


def test_overwrite_clears_and_resume_accepts_the_staged_directory(tmp_path):
    src = _write(tmp_path / "in" / "a.jsonl", [{"id": "a", "prompt": "p"}])
    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {})
    cfg = InputConfig(paths=[src])
    new = stage(sniff_sources(cfg, STORAGE, "jsonl"), cfg, out)
    assert os.path.isfile(new.paths[0])
    again = OutputDir(str(tmp_path / "out"))
    again.check(BehaviourConfig(resume=True), (os.path.dirname(src),), (src,), "m")     # _staged is ours
    again.prepare(BehaviourConfig(overwrite=True), {})
    assert not os.path.exists(new.paths[0])


# ---------------------------------------------------------------- preflight

def test_sniff_names_files_that_are_not_json_lines(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"]}), tmp_path / "data.parquet")
    with pytest.raises(ConfigError, match="looks like a Parquet file") as e:
        sniff_sources(InputConfig(paths=[str(tmp_path / "data.parquet")]), STORAGE, "jsonl")
    assert str(tmp_path / "data.parquet") in str(e.value)

    csv = tmp_path / "table.jsonl"
    csv.write_text("id,prompt\na,p\n")
    with pytest.raises(ConfigError, match="is not JSON Lines .*it looks like CSV") as e:
        sniff_sources(InputConfig(paths=[str(csv)]), STORAGE, "jsonl")
    assert str(csv) in str(e.value)

    packed = tmp_path / "packed.jsonl"
    packed.write_bytes(gzip.compress(b'{"id": "a"}\n'))
    with pytest.raises(ConfigError, match="it looks gzip-compressed: name it .gz"):
        sniff_sources(InputConfig(paths=[str(packed)]), STORAGE, "jsonl")

    batch = _write(tmp_path / "b" / "batch.jsonl", [{"custom_id": "x", "method": "POST", "url": "/v1/completions"},
                                                      _request("y", prompt="p")])
    with pytest.raises(ConfigError, match="not an OpenAI batch file .*no object 'body'") as e:
        sniff_sources(InputConfig(paths=[batch]), STORAGE, "openai_batch")
    assert batch in str(e.value)

    requests = _write(tmp_path / "c" / "requests.jsonl", ["", _request("y", prompt="p")])
    with pytest.raises(ConfigError, match="set input.format: openai_batch"):
        sniff_sources(InputConfig(paths=[requests]), STORAGE, "jsonl")
    assert sniff_sources(InputConfig(paths=[requests]), STORAGE, "openai_batch").files == (requests,)


def test_auto_format_by_extension_and_mixed_formats_refused(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"]}), tmp_path / "p.parquet")
    (tmp_path / "j").mkdir()
    for name in ("a.jsonl", "b.json.gz", "c.ndjson.zst", "skip.txt"):
        (tmp_path / "j" / name).write_bytes(b"")
    assert input_format(InputConfig(paths=[str(tmp_path / "p.parquet")]), STORAGE) == "parquet"
    assert input_format(InputConfig(paths=[str(tmp_path / "j")]), STORAGE) == "jsonl"
    assert input_format(InputConfig(paths=[str(tmp_path / "j")], format="openai_batch"), STORAGE) == "openai_batch"
    with pytest.raises(ConfigError, match="mixes formats") as e:
        input_format(InputConfig(paths=[str(tmp_path)]), STORAGE)
    assert str(tmp_path / "p.parquet") in str(e.value) and str(tmp_path / "j" / "a.jsonl") in str(e.value)
    with pytest.raises(ConfigError, match="cannot tell its format"):
        input_format(InputConfig(paths=[str(tmp_path / "j" / "skip.txt")]), STORAGE)
    files, _, _ = resolve_files(InputConfig(paths=[str(tmp_path / "j")]), STORAGE, JSON_SUFFIXES, "JSONL")
    assert [os.path.basename(f) for f in files] == ["a.jsonl", "b.json.gz", "c.ndjson.zst"]
    with pytest.raises(ConfigError, match="matched no Parquet files"):        # Parquet listing unchanged
        resolve_files(InputConfig(paths=[str(tmp_path / "j")]), STORAGE)


def test_parquet_stop_and_logprobs_override_types(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "stop": [["x"]], "logprobs": [2]}), good / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "prompt": ["p"], "stop": ["y"], "logprobs": [None]}), good / "b.parquet")
    plan = inspect_inputs(InputConfig(paths=[str(good / "a.parquet")]), STORAGE)
    assert set(plan.override_columns) == {"stop", "logprobs"} and not plan.input_error
    inspect_inputs(InputConfig(paths=[str(good / "b.parquet")]), STORAGE)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "stop": [3]}), bad)
    with pytest.raises(ConfigError, match="'stop' has type int64, expected a list of strings or a string"):
        inspect_inputs(InputConfig(paths=[str(bad)]), STORAGE)


# ---------------------------------------------------------------- object store

@pytest.mark.slow
def test_jsonl_on_an_object_store_stages_into_the_output_prefix_and_is_reused(tmp_path, monkeypatch):
    pytest.importorskip("moto")
    from jobs.local_s3 import CLIENT_ENV, moto_server, s3fs

    from pipeline.inputs import staging

    for key, value in CLIENT_ENV.items():
        monkeypatch.setenv(key, value)
    with moto_server() as endpoint:
        fs, storage = s3fs(endpoint), StorageConfig(endpoint=endpoint)
        fs.create_dir("bkt")
        for key, data in {"in/a.jsonl.gz": gzip.compress(_lines([{"id": "a", "prompt": "p"}])),
                          "in/sub/b.jsonl": _lines([{"id": "b", "prompt": "q"}, "oops"]),
                          "in/_hidden.jsonl": b"not json", "in/notes.txt": b"x"}.items():
            with fs.open_output_stream(f"bkt/{key}", compression=None) as f:
                f.write(data)
        cfg = InputConfig(paths=["s3://bkt/in/"])
        assert input_format(InputConfig(paths=["s3://bkt/in/*.jsonl.gz"]), storage) == "jsonl"
        sources = sniff_sources(cfg, storage, "jsonl")
        assert sources.files == ("bkt/in/a.jsonl.gz", "bkt/in/sub/b.jsonl") and sources.scheme == "s3"
        out = OutputDir("s3://bkt/out", storage)
        new = stage(sources, cfg, out)
        assert all(p.startswith("s3://bkt/out/_staged/") for p in new.paths)
        plan = inspect_inputs(new, storage)
        assert plan.num_rows == 3 and plan.input_error and plan.scheme == "s3"

        calls, convert = [], staging.convert
        monkeypatch.setattr(staging, "convert", lambda *a: calls.append(a) or convert(*a))
        assert stage(sources, cfg, out).paths == new.paths and calls == []
        with fs.open_output_stream("bkt/in/sub/b.jsonl") as f:
            f.write(_lines([{"id": "b", "prompt": "changed"}]))
        stage(sources, cfg, out)
        assert [c[2] for c in calls] == ["bkt/in/sub/b.jsonl"]


def test_the_job_refuses_a_file_that_is_not_its_declared_format_before_any_model_loads(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from jobs.generate import main

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"custom_id": ["a"]}), tmp_path / "in" / "requests.jsonl")   # Parquet named .jsonl
    cfg = {"input": {"paths": [str(tmp_path / "in")], "format": "openai_batch"},
           "output": {"path": str(tmp_path / "out")}, "model": {"path": "models/tiny-orthrus-py"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "requests.jsonl" in err and "Parquet" in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- issue 32: bad lines, body keys

def test_a_broken_first_line_is_its_rows_error_and_only_other_formats_are_refused(tmp_path):
    good = [{"id": "g1", "prompt": "p1"}, {"id": "g2", "prompt": "p2"}]
    deep = b'{"id": "d", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases = {"utf8.jsonl": b'{"id": "u", "prompt": "caf\xe9"}', "deep.jsonl": deep, "array.jsonl": b"[1, 2]",
             "scalar.jsonl": b"{broken"}
    for name, first in cases.items():
        path = tmp_path / name.removesuffix(".jsonl") / name
        _write(path, good)
        path.write_bytes(first + b"\n" + path.read_bytes())
    paths = [str(tmp_path / n.removesuffix(".jsonl") / n) for n in cases if n != "array.jsonl"]
    new, _ = _stage(tmp_path, paths, "jsonl")
    rows = [r for p in new.paths for r in _rows(p)]
    assert len(rows) == 3 * len(paths)                                   # rows in == rows out
    errors = {r["id"]: r[INPUT_ERROR] for r in rows if r[INPUT_ERROR]}
    assert errors == {
        "utf8.jsonl:1": "line 1 of utf8.jsonl: not valid UTF-8 (invalid continuation byte at byte 26)",
        "deep.jsonl:1": f"line 1 of deep.jsonl: nested deeper than the JSON parser allows (about "
                        f"{sys.getrecursionlimit()} levels)",
        "scalar.jsonl:1": "line 1 of scalar.jsonl: not valid JSON: Expecting property name enclosed in double quotes "
                          "(column 2)"}
    assert sorted(r["prompt"] for r in rows if not r[INPUT_ERROR]) == ["p1", "p1", "p1", "p2", "p2", "p2"]
    with pytest.raises(ConfigError, match="array.jsonl is not JSON Lines .*looks like a JSON array document"):
        sniff_sources(InputConfig(paths=[str(tmp_path / "array" / "array.jsonl")]), STORAGE, "jsonl")


def test_openai_body_keys_follow_one_rule_and_name_the_users_field_and_line(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path / "in" / "b.jsonl", [
        _request("ok", messages=chat, model="gpt-x", user="u", metadata={"k": "v"}, frequency_penalty=0,
                 presence_penalty=0.0, tools=[], tool_choice="none", store=False),
        _request("freq", messages=chat, frequency_penalty=2.5),
        _request("tools", messages=chat, tools=[{"type": "function", "function": {"name": "f"}}]),
        _request("choice", messages=chat, tool_choice="required"),
        _request("unknown", messages=chat, temprature=0.3),
        _request("zero", messages=chat, max_tokens=0),
        _request("seed", "/v1/completions", prompt="p", seed=-1),
        _request("top", messages=chat, logprobs=True, top_logprobs=99),
    ])
    new, _ = _stage(tmp_path, [path], "openai_batch")
    rows = {r["id"]: r for r in _rows(new.paths[0])}
    assert len(rows) == 8 and rows["ok"][INPUT_ERROR] is None and rows["ok"]["messages"] is not None
    errors = {i: r[INPUT_ERROR] for i, r in rows.items() if i != "ok"}
    assert errors == {
        "freq": "line 2 of b.jsonl: body.frequency_penalty must be a number in [-2, 2] (0 = off), got 2.5",
        "tools": "line 3 of b.jsonl: body.tools: not supported (got [{'type': 'function', 'function': {'name': 'f'}}])",
        "choice": "line 4 of b.jsonl: body.tool_choice: not supported (got 'required')",
        "unknown": "line 5 of b.jsonl: body.temprature: not a field this job knows (got 0.3)",
        "zero": "line 6 of b.jsonl: body.max_tokens must be an int in [1, 1048576], got 0",
        "seed": "line 7 of b.jsonl: body.seed must be None or an int in [0, 2**63), got -1",
        "top": "line 8 of b.jsonl: body.top_logprobs must be None or an int in [0, 20], got 99"}


def test_a_duplicate_custom_id_names_custom_id_the_source_file_and_both_lines(tmp_path):
    from pipeline.inputs.checks import file_ids

    chat = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path / "in" / "b.jsonl", [_request("a", messages=chat), _request("dup", messages=chat), "",
                                                _request("c", messages=chat), _request("dup", messages=chat)])
    new, _ = _stage(tmp_path, [path], "openai_batch")
    assert file_ids(new.paths[0], "id", None).error == (
        f"custom_id 'dup' appears twice in {path}: lines 2 and 5; ids must be unique (they key exactly-once output "
        "and resume)")
    jsonl = _write(tmp_path / "j" / "rows.jsonl", [{"id": 7, "prompt": "p"}, {"id": 7, "prompt": "q"}])
    new, _ = _stage(tmp_path, [jsonl], "jsonl")
    assert file_ids(new.paths[0], "id", None).error.startswith(f"'id' (input.id_column) '7' appears twice in {jsonl}: "
                                                               "lines 1 and 2")


def test_job_columns_that_ask_for_an_unsupported_option_are_their_rows_error(tmp_path):
    path = _write(tmp_path / "j" / "rows.jsonl", [{"id": "a", "prompt": "p", "best_of": 1, "n": 3},
                                                  {"id": "b", "prompt": "p", "best_of": 2}])
    new, _ = _stage(tmp_path, [path], "jsonl")
    errors = {r["id"]: r[INPUT_ERROR] for r in _rows(new.paths[0])}
    assert errors == {"a": None, "b": "line 2 of rows.jsonl: best_of: not supported (got 2)"}
    write_shard(tmp_path / "pq", "rows.parquet", id=["x", "y"], prompt=["p", "q"], best_of=[1, 3],
                n=[1, 5])                                                 # 'n' is data here: passed through
    cfg = job_config(tmp_path / "pq", TOKENIZER_DIR, sampling={"max_new_tokens": 4})
    rows = {r["id"]: r for r in preprocess_rows(cfg)}
    assert rows["x"]["error"] is None and rows["y"]["error"] == "column 'best_of': not supported (got 3)"


def test_a_custom_id_in_two_source_files_names_both_files_and_lines(tmp_path):
    from pipeline.inputs.checks import check_ids
    from pipeline.inputs.plan import inspect_inputs

    chat = [{"role": "user", "content": "hi"}]
    a = _write(tmp_path / "in" / "a.jsonl", [_request("x", messages=chat), _request("dup", messages=chat)])
    b = _write(tmp_path / "in" / "b.jsonl", ["", _request("dup", messages=chat), _request("y", messages=chat)])
    new, _ = _stage(tmp_path, [a, b], "openai_batch")
    with pytest.raises(ConfigError) as e:
        check_ids(inspect_inputs(new))
    assert str(e.value).startswith(f"custom_id 'dup' appears in {a} line 2 and in {b} line 2; ")
