"""output.format renderings (``pipeline/output/export.py``) of real committed parts, without Ray
(``map_tasks`` runs the export task inline)."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import ModelConfig

from pipeline.config import BehaviourConfig, ConfigError
from pipeline.output import export as E
from pipeline.output.directory import ERRORS_JSONL, RESULTS_JSONL, OutputDir, OutputWriteError
from pipeline.output.repair import retry_errors
from pipeline.output.sources import PartSources
from pipeline.schema import output_schema
from pipeline.storage.model_files import load_tokenizer
from support.paths import TOKENIZER_DIR

SCHEMA = output_schema([pa.field("openai_url", pa.string())])
BATCH_KEYS = {"id", "custom_id", "response", "error"}


@pytest.fixture
def out(tmp_path) -> OutputDir:
    o = OutputDir(str(tmp_path / "out"))
    o.prepare(BehaviourConfig(), {"model": "m"})
    return o


def _commit(out: OutputDir, first: int, schema: pa.Schema = SCHEMA, **cols) -> str:
    """Commit rows ``first ..`` of input file f.parquet (n = 1) as one part; ids default to r<index>.
    Built column by column (not ``to_output_table``, whose input is the processor's batch)."""
    count = len(next(iter(cols.values())))
    cols.setdefault("id", [f"r{first + i}" for i in range(count)])
    cols.setdefault("sample_index", [0] * count)
    cols.setdefault("model", ["tiny"] * count)
    table = pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(count, f.type)
                      for f in schema}, schema=schema)
    return out.commit(table, PartSources(1, ("/in/f.parquet",), np.array([[0, first, count]])))


def _lines(out: OutputDir, name: str) -> list[dict]:
    with open(out.store.path(name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _mixed(out: OutputDir) -> None:
    """Two parts: chat and completions rows, one error row each."""
    _commit(out, 0, completion=["a", "b", None], finish_reason=["stop", "length", "error"],
            error=[None, None, "boom"], num_prompt_tokens=[3, 4, 5], num_completion_tokens=[1, 2, 0],
            openai_url=["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"])
    _commit(out, 3, completion=["日本", None], finish_reason=["stop", "error"], error=[None, "bad input"],
            num_prompt_tokens=[2, 0], num_completion_tokens=[7, 0], openai_url=[None, "/v1/completions"])


# ---------------------------------------------------------------- jsonl

def test_jsonl_has_one_object_per_row_and_round_trips(out):
    _commit(out, 0, completion=["héllo", None], finish_reason=["stop", "error"], error=[None, "x"],
            token_logprobs=pa.array([[-0.1, -2.3456788], None], pa.list_(pa.float32())),
            top_logprobs=[[[{"id": 5, "logprob": -0.1}], []], None], accept_length_histogram=[[1, 2], None],
            openai_url=["/v1/completions", None])
    _commit(out, 2, completion=["日本"], finish_reason=["length"])
    done = E.export(out, "jsonl")
    assert done == {"results": out.store.path(RESULTS_JSONL), "errors": None, "results_lines": 3, "error_lines": 0}
    text = Path(done["results"]).read_text(encoding="utf-8")
    assert "日本" in text and "-0.1," in text             # ensure_ascii=False; shortest float32 form
    rows = _lines(out, RESULTS_JSONL)
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"] and set(rows[0]) == set(SCHEMA.names)
    assert rows[0]["top_logprobs"] == [[{"id": 5, "logprob": -0.1}], []] and rows[1]["token_logprobs"] is None
    assert pa.Table.from_pylist(rows, schema=SCHEMA).equals(out.read())
    assert not (out.store.root / ERRORS_JSONL).exists()


def test_jsonl_renders_non_finite_floats_and_odd_pass_through_types_as_json(out):
    schema = output_schema([pa.field("when", pa.timestamp("s")), pa.field("blob", pa.binary())])
    _commit(out, 0, schema, completion=["x"], finish_reason=["stop"], tokens_per_cycle=[float("nan")],
            cumulative_logprob=[float("-inf")], when=pa.array([0], pa.timestamp("s")), blob=[b"\x00\xff"])
    E.export(out, "jsonl")
    row = _lines(out, RESULTS_JSONL)[0]
    assert row["tokens_per_cycle"] is None and row["cumulative_logprob"] is None
    assert row["when"] == "1970-01-01T00:00:00" and row["blob"] == "AP8="


# ---------------------------------------------------------------- openai_batch

def test_openai_batch_splits_successes_and_errors_with_every_custom_id_once(out):
    _mixed(out)
    done = E.export(out, "openai_batch")
    assert (done["results_lines"], done["error_lines"]) == (3, 2)
    results, errors = _lines(out, RESULTS_JSONL), _lines(out, ERRORS_JSONL)
    ids = [r["custom_id"] for r in results + errors]
    assert sorted(ids) == [f"r{i}" for i in range(5)] and len(set(ids)) == 5
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r3"]      # part-name order, rows in part order
    for line in results + errors:
        assert set(line) == BATCH_KEYS and line["id"].startswith("batch_req_") and len(line["id"]) == 34
        int(line["id"][10:], 16)
    assert errors[0] == {"id": errors[0]["id"], "custom_id": "r2", "response": None,
                         "error": {"code": "row_error", "message": "boom"}}
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    assert len({r["response"]["request_id"] for r in results}) == 3


def test_openai_batch_chat_and_completions_bodies(out):
    _mixed(out)
    E.export(out, "openai_batch")
    chat, text, default = (r["response"]["body"] for r in _lines(out, RESULTS_JSONL))
    assert set(chat) == {"id", "object", "created", "model", "choices", "usage"} and chat["object"] == "chat.completion"
    assert chat["id"].startswith("chatcmpl-") and isinstance(chat["created"], int) and chat["model"] == "tiny"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-")
    assert text["choices"] == [{"index": 0, "text": "b", "logprobs": None, "finish_reason": "length"}]
    assert default["object"] == "chat.completion" and default["choices"][0]["message"]["content"] == "日本"


def test_openai_batch_without_openai_url_column_is_chat(out):
    _commit(out, 0, output_schema([]), completion=["a"], finish_reason=["stop"])
    E.export(out, "openai_batch")
    assert _lines(out, RESULTS_JSONL)[0]["response"]["body"]["object"] == "chat.completion"


def _logprob_rows(out: OutputDir, with_ids: bool) -> list[int]:
    tok = load_tokenizer(str(TOKENIZER_DIR))
    ids = tok("héllo world", add_special_tokens=False)["input_ids"][:3]
    schema = output_schema([pa.field("openai_url", pa.string())])
    at = schema.get_field_index(E.GENERATED_IDS)          # older parts lack the column: both are exported
    if with_ids and at < 0:
        schema = schema.append(pa.field(E.GENERATED_IDS, pa.list_(pa.int32())))
    elif not with_ids and at >= 0:
        schema = schema.remove(at)
    cols = {E.GENERATED_IDS: [ids, ids]} if with_ids else {}
    tops = [[{"id": i, "logprob": -0.5}, {"id": ids[0], "logprob": -1.5}] for i in ids]
    _commit(out, 0, schema, completion=["x", "y"], finish_reason=["stop", "length"],
            token_logprobs=pa.array([[-0.25, float("-inf"), -1.0]] * 2, pa.list_(pa.float32())),
            top_logprobs=[tops, tops], openai_url=[None, "/v1/completions"], **cols)
    return ids


@pytest.mark.parametrize("with_ids", [True, False])
def test_openai_batch_logprobs_use_the_tokenizer(out, with_ids):
    ids = _logprob_rows(out, with_ids)
    text = E.TokenText(load_tokenizer(str(TOKENIZER_DIR)))
    E.export(out, "openai_batch", ModelConfig(path=str(TOKENIZER_DIR)))
    chat, comp = (r["response"]["body"]["choices"][0]["logprobs"] for r in _lines(out, RESULTS_JSONL))
    content = chat["content"]
    assert [c["logprob"] for c in content] == [-0.25, E.UNLIKELY, -1.0]     # JSON has no -inf
    assert [set(c) for c in content] == [{"token", "logprob", "bytes", "top_logprobs"}] * 3
    first_top = content[0]["top_logprobs"][0]
    assert first_top == {"token": text(ids[0])[0], "logprob": -0.5, "bytes": text(ids[0])[1]}
    if with_ids:
        assert [c["token"] for c in content] == [text(i)[0] for i in ids]
        assert [c["bytes"] for c in content] == [text(i)[1] for i in ids]
        assert comp["tokens"] == [text(i)[0] for i in ids] and comp["text_offset"][0] == 0
        assert comp["text_offset"][1] == len(text(ids[0])[0])
    else:   # the generated token is not in the output: nothing is guessed
        assert all(c["token"] is None and c["bytes"] is None for c in content)
        assert comp["tokens"] == [None] * 3 and comp["text_offset"] == [None] * 3
    assert set(comp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert comp["token_logprobs"] == [-0.25, E.UNLIKELY, -1.0]
    assert comp["top_logprobs"][1] == {text(ids[1])[0]: -0.5, text(ids[0])[0]: -1.5}


def test_token_bytes_rebuild_characters_split_across_tokens():
    tok = load_tokenizer(str(TOKENIZER_DIR))
    text = E.TokenText(tok)
    ids = tok("héllo 日本語", add_special_tokens=False)["input_ids"]
    assert bytes(sum((text(i)[1] for i in ids), [])).decode() == "héllo 日本語"
    assert any(text(i)[0] == "\ufffd" for i in ids)        # a token holding part of a character


def test_openai_batch_logprobs_need_the_tokenizer_and_leave_nothing_without_it(out):
    _logprob_rows(out, with_ids=False)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        E.export(out, "openai_batch")
    assert not (out.store.root / RESULTS_JSONL).exists() and not list(out.tmp.iterdir())


def test_ids_are_deterministic_and_a_rerun_rewrites_after_resume_and_repair(out, monkeypatch):
    _mixed(out)
    first = E.export(out, "openai_batch")
    before = _lines(out, RESULTS_JSONL) + _lines(out, ERRORS_JSONL)
    monkeypatch.setattr(E.time, "time", lambda: 2_000_000_000.0)      # a later export: only created differs
    assert E.export(out, "openai_batch") == first
    again = _lines(out, RESULTS_JSONL) + _lines(out, ERRORS_JSONL)
    assert [(a["id"], a["custom_id"]) for a in again] == [(b["id"], b["custom_id"]) for b in before]
    assert [a["response"] and a["response"]["body"]["id"] for a in again] == \
           [b["response"] and b["response"]["body"]["id"] for b in before]
    assert again[0]["response"]["body"]["created"] == 2_000_000_000
    assert retry_errors(out) == 2                    # --retry-errors, then the resumed run commits them
    _commit(out, 5, id=["r2", "r4"], completion=["c", "d"], finish_reason=["stop", "stop"])
    done = E.export(out, "openai_batch")
    assert (done["results_lines"], done["error_lines"]) == (5, 0)
    assert _lines(out, ERRORS_JSONL) == [] and sorted(r["custom_id"] for r in _lines(out, RESULTS_JSONL)) == \
           [f"r{i}" for i in range(5)]


class _Failing:
    """A sink stream whose second write finds the disk full."""

    def __init__(self, stream) -> None:
        self.stream, self.writes = stream, 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_a_failed_write_leaves_the_previous_files_whole(out, monkeypatch):
    _mixed(out)
    E.export(out, "jsonl")
    old = (out.store.root / RESULTS_JSONL).read_bytes()
    _commit(out, 5, completion=["new"], finish_reason=["stop"])
    sink = out.store.sink
    monkeypatch.setattr(out.store, "sink", lambda dest: (lambda s, t: (_Failing(s), t))(*sink(dest)))
    with pytest.raises(OutputWriteError, match="results.jsonl.*No space left"):
        E.export(out, "jsonl")
    assert (out.store.root / RESULTS_JSONL).read_bytes() == old and not list(out.tmp.iterdir())


# ---------------------------------------------------------------- the job's side

def test_parquet_is_nothing_to_do_and_unknown_formats_are_refused(out):
    _mixed(out)
    assert E.export(out, "parquet") == {}
    assert not (out.store.root / RESULTS_JSONL).exists()
    with pytest.raises(ValueError, match="csv"):
        E.export(out, "csv")


def test_a_jsonl_export_drops_an_older_openai_errors_file(out):
    _mixed(out)
    E.export(out, "openai_batch")
    assert (out.store.root / ERRORS_JSONL).exists()
    E.export(out, "jsonl")
    assert not (out.store.root / ERRORS_JSONL).exists() and len(_lines(out, RESULTS_JSONL)) == 5


def test_check_openai_batch_n():
    E.check_openai_batch_n(1)
    with pytest.raises(ConfigError, match=r"output\.format.*sampling\.n = 2"):
        E.check_openai_batch_n(2)


def test_rendered_files_are_ours_for_resume_and_overwrite(out, tmp_path):
    _mixed(out)
    E.export(out, "openai_batch")
    OutputDir(str(tmp_path / "out")).check(BehaviourConfig(resume=True), (), (), "m")   # not foreign
    OutputDir(str(tmp_path / "out")).prepare(BehaviourConfig(overwrite=True), {"model": "m"})
    assert not (out.store.root / RESULTS_JSONL).exists() and not (out.store.root / ERRORS_JSONL).exists()
