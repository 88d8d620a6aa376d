"""Bad inputs without a Ray cluster: each ends as an error row or an error naming file and field, found
up front (preflight's footers, the id check before the first commit, ``input.verify: full``) or by the
read task of the file.

Real Parquet files, the real tokenizer and (for the stage) the real engine on a tiny random
checkpoint. The same inputs also run end to end through Ray in ``test_faults_ray.py``.
"""
from __future__ import annotations

import asyncio

import math
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import BehaviourConfig, ConfigError
from pipeline.requests.errors import FORMAT
from pipeline.output.directory import OutputDir, read_footer
from pipeline.output.parts import PartWriter
from pipeline.report.progress import Progress
from pipeline.report.throughput import ThroughputTracker
from pipeline import schema as S
from pipeline.inputs.checks import check_ids, verify_inputs
from pipeline.inputs.source import InputFileError, read_file
from pipeline.run.commit import CommitLoop, run_loop
from pipeline.run.job import preflight
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.actor.stage import GenerationStage, StagePlan
from support.hang import HANG_S
from support.job_inputs import MSG, job_config, raw_strings, write_shard

def corrupt_pages(path: Path) -> None:
    """Overwrite bytes inside the first data page; the footer (schema, row counts) stays readable."""
    data = bytearray(path.read_bytes())
    data[40:104] = b"\xff" * 64
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- up-front errors (preflight, id check, full read)

def _write(t: Path, name: str, **cols) -> Path:
    return write_shard(t, name, **cols)


# Where each is found: "preflight" (footers: types, schemas, unreadable files), "ids" (``check_ids``:
# Ray tasks while the actors load; the first commit waits for it), "read" (a corrupt page: up front
# with ``input.verify: full``, else the read task of its row group, mid-run).
PREFLIGHT, IDS, READ = "preflight", "ids", "read"


@pytest.mark.parametrize("found_by, setup, message", [
    # wrong column types: the message names the file that has the bad type, not just the first file
    (PREFLIGHT, lambda t: (_write(t, "a.parquet", id=["x"], messages=[MSG % "hi"]),
                           _write(t, "b.parquet", id=["y"], prompt=[3])),
     r"input column 'prompt' has type int64, expected string \(in .*b.parquet\)"),
    (PREFLIGHT, lambda t: _write(t, "a.parquet", id=["x"], messages=[5]), r"'messages' has type int64, expected list"),
    (PREFLIGHT, lambda t: (_write(t, "a.parquet", id=["x"], prompt=["p"]),
                           _write(t, "b.parquet", id=["y"], prompt=["q"], temperature=["hot"])),
     r"'temperature' has type string, expected a number \(in .*b.parquet\)"),
    (PREFLIGHT, lambda t: _write(t, "a.parquet", id=[1.5], prompt=["p"]),
     r"'id' has type double, expected string or integer"),
    # shards with incompatible schemas: field and both files named
    (PREFLIGHT, lambda t: (_write(t, "a.parquet", id=["x"], prompt=["p"], score=["high"]),
                           _write(t, "b.parquet", id=["y"], prompt=["q"], score=[3])),
     r"input column 'score' has type string in .*a.parquet but int64 in .*b.parquet"),
    (PREFLIGHT, lambda t: (_write(t, "a.parquet", id=["1"], prompt=["p"]), _write(t, "b.parquet", id=[1], prompt=["q"])),
     r"input column 'id' has type string in .*a.parquet but int64 in .*b.parquet"),
    # duplicate ids (within a file, across files): the id and the file(s) named
    (IDS, lambda t: _write(t, "a.parquet", id=["x", "y", "x"], prompt=["p", "q", "r"]),
     r"1 duplicate id\(s\), e.g. 'x' \(in .*a.parquet\)"),
    (IDS, lambda t: (_write(t, "a.parquet", id=[7, 8], prompt=["p", "q"]), _write(t, "b.parquet", id=[8], prompt=["r"])),
     r"duplicate id\(s\), e.g. '8' \(in .*a.parquet and .*b.parquet\)"),
    (IDS, lambda t: _write(t, "a.parquet", id=pa.array(["x", None, None], pa.string()), prompt=["p", "q", "r"]),
     r"a.parquet: 2 row\(s\) have a null 'id' \(input.id_column\), first at row 1"),
    # invalid UTF-8 in the id column (ids key the output: no error row can carry a broken key)
    (IDS, lambda t: _write(t, "a.parquet", id=raw_strings([b"ok", b"bad\xff"]), prompt=["p", "q"]),
     r"a.parquet: id column 'id' \(input.id_column\) holds invalid text: .*Invalid UTF8"),
    # corrupt Parquet: garbage, empty, truncated (no footer), and a readable footer over corrupt pages
    (PREFLIGHT, lambda t: (t / "in").mkdir() or (t / "in" / "z.parquet").write_bytes(b""),
     r"z.parquet is not a readable"),
    (PREFLIGHT, lambda t: (t / "in").mkdir() or (t / "in" / "z.parquet").write_bytes(b"PAR1" + b"\0" * 64),
     r"z.parquet is not a readable Parquet file"),
    (PREFLIGHT, lambda t: (p := _write(t, "z.parquet", id=["a"] * 1, prompt=["p"])).write_bytes(p.read_bytes()[:-30]),
     r"z.parquet is not a readable Parquet file"),
    (READ, lambda t: corrupt_pages(_write(t, "z.parquet", id=[f"r{i}" for i in range(200)],
                                          prompt=[f"def f{i}(): return {i}" * 3 for i in range(200)])),
     r"input file .*z.parquet is corrupt \(row group 0 of 1\)"),
])
def test_bad_files_fail_up_front_naming_file_and_field(tmp_path, weightless_model, found_by, setup, message):
    setup(tmp_path)
    if found_by == PREFLIGHT:
        with pytest.raises(ConfigError, match=message):
            preflight(job_config(tmp_path, weightless_model))
        return
    inputs = preflight(job_config(tmp_path, weightless_model)).inputs   # footers only: rows are checked where read
    if found_by == IDS:
        with pytest.raises(ConfigError, match=message):
            check_ids(inputs)             # Ray tasks in a job (inline without Ray); the first commit waits for it
        return
    with pytest.raises(ConfigError, match=message):
        verify_inputs(inputs)             # input.verify: full, before any actor loads the model
    with pytest.raises(InputFileError, match=message):
        read_file(inputs, 0, 1)           # otherwise the file's read task, mid-run


def _commit_loop(tmp_path: Path, files: tuple[str, ...], ids_checked: Future | None) -> tuple[OutputDir, CommitLoop]:
    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {"model": "m"})
    writer = PartWriter(out, S.output_schema([]), files, 1, part_bytes=1 << 30, part_seconds=3600)
    return out, CommitLoop(writer, writer.schema, ThroughputTracker(), Progress(3, 0, lambda _: None, bar=False),
                           ids_checked)


def _block(ids: list[str], rows: list[int]) -> pa.Table:
    """Finished rows as the actors return them: output columns and each row's coordinate."""
    return pa.table({"id": ids, "sample_index": [0] * len(ids), "finish_reason": ["length"] * len(ids),
                     S.FILE: pa.array([0] * len(ids), pa.int32()), S.ROW: pa.array(rows, pa.int64())})


def test_a_failed_id_check_stops_the_job_before_anything_is_committed(tmp_path, weightless_model):
    _write(tmp_path, "a.parquet", id=["x", "y", "x"], prompt=["p", "q", "r"])
    inputs = preflight(job_config(tmp_path, weightless_model)).inputs
    ids_checked: Future = Future()
    out, loop = _commit_loop(tmp_path, inputs.files, ids_checked)
    try:
        check_ids(inputs)
    except ConfigError as e:
        ids_checked.set_exception(e)
    with pytest.raises(ConfigError, match=r"1 duplicate id\(s\), e.g. 'x'"):
        run_loop(iter([_block(["x", "y"], [0, 1])]), loop, None)   # rows were generated meanwhile
    assert out.part_files() == [] and not list(out.tmp.iterdir())


def test_a_corrupt_file_found_mid_run_commits_what_was_read_and_names_the_file(tmp_path, weightless_model):
    _write(tmp_path, "a.parquet", id=["a0", "a1"], prompt=["p", "q"])
    corrupt_pages(_write(tmp_path, "z.parquet", id=[f"r{i}" for i in range(200)],
                         prompt=[f"def f{i}(): return {i}" * 3 for i in range(200)]))
    inputs = preflight(job_config(tmp_path, weightless_model)).inputs
    ids_checked: Future = Future()
    ids_checked.set_result(None)
    out, loop = _commit_loop(tmp_path, inputs.files, ids_checked)

    def blocks():
        yield _block(["a0", "a1"], [0, 1])
        read_file(inputs, 1, 1)           # z.parquet's read task

    with pytest.raises(InputFileError, match=r"input file .*z.parquet is corrupt \(row group 0 of 1\)"):
        run_loop(blocks(), loop, None)
    (part,) = out.part_files()            # the rows read before it are committed (--resume goes on from them)
    assert pq.read_table(part)["id"].to_pylist() == ["a0", "a1"] and not list(out.tmp.iterdir())
    sources = read_footer(part, None).sources
    assert sources.files == (inputs.files[0],) and sources.runs.tolist() == [[0, 0, 2]]


# ---------------------------------------------------------------- error rows (preprocessing)

# (id, prompt, messages, overrides, expected error substring or None for a good row)
ROWS = [
    ("good", "def f(x):", None, {}, None),
    ("good-msg", None, MSG % "hi", {}, None),
    ("ctrl", "def f():\x00\x1b[31m\x07\r", None, {}, None),       # control characters are text: generated
    ("null", None, None, {}, "prompt and messages are both missing"),
    ("empty", "", None, {}, "prompt is empty"),
    ("blank", "  \n\t ", None, {}, "prompt is whitespace-only"),
    ("msg-json", None, "[{'role': 'user'", {}, "messages is not valid JSON"),
    ("msg-dict", None, '{"role": "user", "content": "x"}', {}, "messages must be a non-empty list"),
    ("msg-empty", None, "[]", {}, "messages must be a non-empty list"),
    ("msg-nocontent", None, MSG % "   ", {}, "messages have no content"),
    ("msg-parts", None, '[{"role": "user", "content": [{"type": "text", "text": "x"}]}]', {},
     "messages[0] must have string 'role' and 'content'"),
    ("msg-surrogate", None, MSG % "\\ud800", {}, "is not valid Unicode: surrogates not allowed"),
    ("bad-utf8", b"def \xff\xfe():", None, {}, "column 'prompt' is not valid UTF-8"),
    ("temp-neg", "x", None, {"temperature": -1.0}, "column 'temperature' must be a finite number >= 0"),
    ("temp-nan", "x", None, {"temperature": math.nan}, "column 'temperature' must be a finite number >= 0"),
    ("temp-inf", "x", None, {"temperature": math.inf}, "column 'temperature' must be a finite number >= 0"),
    ("top-p-0", "x", None, {"top_p": 0.0}, "column 'top_p' must be in (0, 1]"),
    ("top-p-big", "x", None, {"top_p": 1.5}, "column 'top_p' must be in (0, 1]"),
    ("top-k-neg", "x", None, {"top_k": -1.0}, "column 'top_k' must be an int >= 0"),
    ("top-k-frac", "x", None, {"top_k": 0.5}, "'top_k' must be an integer"),
    ("max-0", "x", None, {"max_new_tokens": 0.0}, "column 'max_new_tokens' must be an int in [1,"),
    ("max-neg", "x", None, {"max_new_tokens": -5.0}, "column 'max_new_tokens' must be an int in [1,"),
    ("max-absurd", "x", None, {"max_new_tokens": 1e12}, "column 'max_new_tokens' must be an int in [1,"),
    ("seed-neg", "x", None, {"seed": -1}, "column 'seed' must be an int in [0, 2**63)"),
]
OVERRIDES = {"temperature": pa.float64(), "top_p": pa.float64(), "top_k": pa.float64(),
             "max_new_tokens": pa.float64(), "seed": pa.int64()}


def bad_rows_table() -> pa.Table:
    """Every row-level bad input of ``ROWS`` plus unknown extra columns of odd types and names."""
    prompts = [p.encode() if isinstance(p, str) else p for _, p, _, _, _ in ROWS]
    n = len(ROWS)
    cols = {"id": [r[0] for r in ROWS], "prompt": raw_strings(prompts), "messages": [r[2] for r in ROWS]}
    for name, typ in OVERRIDES.items():
        cols[name] = pa.array([r[3].get(name) for r in ROWS], typ)
    cols["../../escape"] = list(range(n))                         # names from data: columns, never paths
    cols["meta"] = pa.array([{"k": i, "tags": ["a", "b"]} for i in range(n)])
    cols["blob"] = pa.array([bytes([i, 0, 255]) for i in range(n)], pa.binary())
    return pa.table(cols)


@pytest.mark.parametrize("chat_template", ["auto", "off"])
def test_bad_rows_become_error_rows_rows_in_equal_rows_out(tmp_path, weightless_model, chat_template):
    table = bad_rows_table()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "bad.parquet")
    cfg = job_config(tmp_path, weightless_model, prompt={"chat_template": chat_template}, sampling={"n": 2})
    inputs = preflight(cfg).inputs
    assert inputs.passthrough == ("../../escape", "meta", "blob")
    plan = PreprocessPlan(inputs=inputs, model=cfg.model, prompt=cfg.prompt, sampling=cfg.sampling)
    out = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), plan)   # as the read task gives it
    assert out.num_rows == 2 * table.num_rows                      # rows in x n == rows out
    rows = {(r["id"], r["sample_index"]): r for r in out.to_pylist()}
    by_id = {r[0]: r for r in ROWS}
    for (row_id, _), r in rows.items():
        expected = by_id[row_id][4]
        if chat_template == "off" and by_id[row_id][1] is None:    # messages need a chat template
            expected = "prompt is missing"
        if expected is None:
            assert r["error"] is None and r["__request"]["prompt_token_ids"], r
        else:
            assert r["error"] and expected in r["error"], (row_id, r["error"])
            assert FORMAT.match(r["error"]), r["error"]          # the documented format (errors.py)
            assert r["__request"] is None
    extra = ["id", "../../escape", "meta", "blob"]  # unknown columns pass through unchanged
    want = table.select(extra).take([i // 2 for i in range(out.num_rows)])
    assert out.select(extra).to_pylist() == want.to_pylist()


# ---------------------------------------------------------------- engine-side rows and out-of-memory retry

@pytest.fixture
def one_thread():
    """One torch thread, like an actor with one CPU: two spinning threads crawl on a busy 2-core box."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stage(cfg, fault: str | None = None) -> GenerationStage:
    from pipeline.actor.faults import FaultyStage

    plan = StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False)
    return GenerationStage(plan) if fault is None else FaultyStage(plan, fault)


def test_oom_batches_split_and_retry_and_a_row_failing_alone_is_an_error_row(tmp_path, tiny_orthrus_dir, capsys,
                                                                              one_thread):
    ids = [f"r{i}" for i in range(7)]
    write_shard(tmp_path, "a.parquet", id=ids + ["long", "huge-max"],
           prompt=[f"def f{i}(x):" for i in range(7)] + ["x = 1\n" * 60, "def g():"],
           max_new_tokens=pa.array([None] * 8 + [1_000_000], pa.int64()))
    cfg = job_config(tmp_path, tiny_orthrus_dir, prompt={"chat_template": "off"},
                  sampling={"max_new_tokens": 5, "temperature": 0.8, "seed": 3},
                  engine={"max_batch_size": 4, "max_seq_len": 48})
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt,
                                                                                 cfg.sampling))
    clean = {r["id"]: r for r in asyncio.run(_stage(cfg)(batch)).to_pylist()}
    faulty = asyncio.run(_stage(cfg, "oom_if_batch_gt:2,oom_on_id:r3")(batch)).to_pylist()
    log = capsys.readouterr().out
    assert "fault injection active" in log and "OutOfMemoryError on 8 rows; retrying as 4 + 4" in log
    assert len(faulty) == batch.num_rows == 9
    for r in faulty:
        if r["id"] == "r3":  # out of memory even alone: an error row with the message
            assert r["finish_reason"] == "error" and r["generated_text"] is None
            assert "decoding failed: OutOfMemoryError: simulated out of memory" in r["error"]
            continue
        c = clean[r["id"]]  # every other row decodes exactly as without the fault (seeded per row)
        keys = ("generated_text", "finish_reason", "error", "num_generated_tokens", "accept_length_histogram", "seed")
        assert {k: r[k] for k in keys} == {k: c[k] for k in keys}, r["id"]
    assert "tokens; the context limit max_seq_len=48 leaves no room" in clean["long"]["error"]
    huge = clean["huge-max"]  # an allowed but absurd max_new_tokens is bounded by the context limit
    assert huge["finish_reason"] == "length" and huge["num_input_tokens"] + huge["num_generated_tokens"] == 48


def test_fault_spec_is_checked():
    from pipeline.actor.faults import FaultInjector

    assert FaultInjector.parse(None) is None and FaultInjector.parse("") is None
    assert FaultInjector.parse("oom_if_batch_gt:3,oom_on_id:a:b").oom_ids == {"a:b"}
    with pytest.raises(ValueError, match="cannot parse 'oom_if_batch_gt:x'"):
        FaultInjector.parse("oom_if_batch_gt:x")
    for bad in ("hold_after:1", "hold_after:x:/tmp/go", "hold_after::/tmp/go"):
        with pytest.raises(ValueError, match="cannot parse"):
            FaultInjector.parse(bad)


def test_hold_after_is_a_barrier_on_a_file(tmp_path):
    """The first N batches pass; a later one waits for the file, however long, and goes on once it exists."""
    from pipeline.actor.faults import FaultInjector

    gate = tmp_path / "go"
    faults = FaultInjector.parse(f"oom_on_id:x,hold_after:2:{gate}")
    assert (faults.hold_after, faults.hold_file, faults.oom_ids) == (2, str(gate), {"x"})

    async def scenario() -> None:
        await asyncio.wait_for(faults.hold(0), HANG_S)
        await asyncio.wait_for(faults.hold(1), HANG_S)
        held = asyncio.ensure_future(faults.hold(2))
        await asyncio.sleep(0.3)
        assert not held.done()                  # no file: no time makes it pass
        gate.touch()
        await asyncio.wait_for(held, HANG_S)

    asyncio.run(scenario())


def test_the_fault_variable_selects_the_faulty_stage(monkeypatch):
    from pipeline.actor.faults import FAULT_ENV, FaultyStage, stage_for

    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert stage_for(GenerationStage) == (GenerationStage, {})
    monkeypatch.setenv(FAULT_ENV, "oom_on_id:r4")
    assert stage_for(GenerationStage) == (FaultyStage, {"faults": "oom_on_id:r4"})
    assert issubclass(FaultyStage, GenerationStage)
    monkeypatch.setenv(FAULT_ENV, "oom_if_batch_gt:x")
    with pytest.raises(ValueError, match="cannot parse 'oom_if_batch_gt:x'"):     # in the driver, up front
        stage_for(GenerationStage)


def test_shards_with_differing_schemas_preprocess_to_one_schema(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=pa.array([1, 2], pa.int32()), prompt=["p", "q"],
           big=pa.array([2 ** 52 + 1, 3], pa.int64()), tag=["x", "y"])
    write_shard(tmp_path, "b.parquet", id=pa.array([3], pa.int64()), messages=[MSG % "hi"], big=[0.5],
           top_k=pa.array([4], pa.int8()))
    write_shard(tmp_path, "c.parquet", id=pa.array([], pa.int64()), prompt=pa.array([], pa.large_string()))
    cfg = job_config(tmp_path, weightless_model)
    inputs = preflight(cfg).inputs
    assert inputs.num_rows == 3 and inputs.schema.field("big").type == pa.float64()
    plan = PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling)
    outs = [preprocess_batch(read_file(inputs, i, cfg.sampling.n), plan) for i in range(len(inputs.files))]
    assert [t.num_rows for t in outs] == [2, 1, 0]
    assert all(t.schema.field("big").type == pa.float64() for t in outs[:2])
    assert outs[0]["big"].to_pylist() == [float(2 ** 52 + 1), 3.0] and outs[1]["big"].to_pylist() == [0.5]
    rows = pa.concat_tables(outs[:2], promote_options="default").to_pylist()
    assert [(r["id"], r["error"], r["__request"]["top_k"], r["tag"]) for r in rows] == [
        ("1", None, 0, "x"), ("2", None, 0, "y"), ("3", None, 4, None)]
