"""The pieces that keep the driver's work bounded by files and parts (no Ray): part sources and the
resume ranges built from them, footer aggregates, the distributed id check run inline, the
streaming part writer, and input errors found in read tasks."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import BehaviourConfig, ConfigError, InputConfig
from pipeline.output import stats as St
from pipeline.output.directory import OutputDir, read_footer
from pipeline.output.parts import PartWriter
from pipeline.output.sources import DoneSet, PartSources, merge, runs_of, subtract
from pipeline.inputs.checks import bucket_of, check_ids, overlapping, FileIds
from pipeline.inputs.plan import inspect_inputs
from pipeline.schema import OUTPUT_FIELDS, output_schema, to_output_table
from pipeline.inputs.source import InputFileError, ReadSpec, read_row_group, row_group_tasks
from pipeline.report.summary import statistics
from pipeline.run.commit import input_error


# ---------------------------------------------------------------- sources and resume ranges

def test_runs_merge_subtract():
    runs = runs_of(np.array([0, 0, 0, 1, 1, 0]), np.array([4, 5, 6, 0, 2, 7]))
    assert runs.tolist() == [[0, 4, 3], [1, 0, 1], [1, 2, 1], [0, 7, 1]]
    merged, twice = merge(np.array([[5, 9], [0, 3], [2, 6], [12, 13]]))
    assert merged.tolist() == [[0, 9], [12, 13]] and twice == 1 + 1      # 2 and 5 covered twice
    assert subtract(np.array([[0, 10], [20, 30]]), np.array([[2, 4], [8, 22]])).tolist() == [[0, 2], [4, 8], [22, 30]]


def test_part_sources_round_trip_and_keep():
    src = PartSources(2, ("a", "b"), np.array([[0, 0, 4], [1, 6, 2]]))
    back = PartSources.decode(src.encode())
    assert back.n == 2 and back.files == ("a", "b") and back.runs.tolist() == src.runs.tolist()
    kept = src.keep(np.array([True, False, True, True, True, True]))
    assert kept.runs.tolist() == [[0, 0, 1], [0, 2, 2], [1, 6, 2]] and kept.num_rows == 5


def test_done_set_pending_per_file_and_sample_even_when_n_changed():
    done = DoneSet()
    done.add(PartSources(2, ("f", "g"), np.array([[0, 0, 6], [1, 0, 4]])))   # f rows 0-2 both samples; g rows 0-1
    done.add(PartSources(2, ("f",), np.array([[0, 7, 1]])))                  # f row 3, sample 1
    assert done.rows == 11
    pending = done.pending(("f", "g", "h"), (4, 2, 5), 2)
    assert "g" not in pending and pending["h"] is None                        # g finished, h untouched
    assert pending["f"].samples(np.arange(4)).to_pylist() == [[], [], [], [0]]
    more = done.pending(("f", "g"), (4, 2), 3)                                # resumed with n = 3
    assert more["g"].samples(np.arange(2)).to_pylist() == [[2], [2]]
    assert more["f"].samples(np.arange(4)).to_pylist() == [[2], [2], [2], [0, 2]]
    twice = DoneSet()
    twice.add(PartSources(1, ("f",), np.array([[0, 0, 3]])))
    twice.add(PartSources(1, ("f",), np.array([[0, 2, 2]])))
    assert twice.merged()[1] == 1


# ---------------------------------------------------------------- footer aggregates

def _rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    reasons = rng.choice(["stop", "length", "error"], n)
    ok = reasons != "error"
    return pa.table({
        "id": [f"r{seed}-{i}" for i in range(n)], "finish_reason": reasons,
        "error": [None if o else "bad" for o in ok],
        "num_completion_tokens": pa.array(np.where(ok, rng.integers(1, 50, n), 0), pa.int64()).to_pylist(),
        "num_cycles": pa.array(np.where(ok, rng.integers(1, 9, n), 0)).to_pylist(),
        "tokens_per_cycle": rng.uniform(1, 4, n),
        "accept_length_histogram": [list(rng.integers(0, 5, int(rng.integers(1, 5)))) for _ in range(n)],
        "time_in_engine_s": rng.exponential(2.0, n),
    })


def test_stats_merge_equals_stats_of_the_union_and_quantiles_are_close():
    a, b = _rows(300, 1), _rows(200, 2)
    merged, whole = St.merge(St.of_table(a), St.of_table(b)), St.of_table(pa.concat_tables([a, b]))
    for key in ("rows", "error", "finish_reason", "sums", "histogram"):
        assert merged[key] == whole[key]
    assert merged["speculation"]["tpc_sum"] == pytest.approx(whole["speculation"]["tpc_sum"])
    q = St.quantiles(merged["times"]["time_in_engine_s"])
    ok = pa.concat_tables([a, b]).filter(pa.compute.not_equal(pa.concat_tables([a, b])["finish_reason"], "error"))
    values = ok["time_in_engine_s"].to_numpy()
    assert q["max"] == round(values.max(), 4)
    for name, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert q[name] == pytest.approx(np.quantile(values, p), rel=0.05)


# ---------------------------------------------------------------- ids: checked by tasks, not the driver

def _shard(d, name: str, **cols):
    d.mkdir(exist_ok=True)
    pq.write_table(pa.table(cols), d / name)


def test_id_ranges_that_do_not_overlap_settle_uniqueness():
    s = [FileIds("a", 2, "a0", "a9"), FileIds("b", 2, "b0", "b9"), FileIds("c", 2, "a5", "a7"), FileIds("e", 0)]
    assert overlapping(s) == ["a", "c"]
    assert overlapping(s[:2]) == []
    ids = pa.array([f"id-{i}" for i in range(1000)] + [""])
    buckets = bucket_of(ids, 8)
    assert buckets.min() >= 0 and buckets.max() < 8 and len(set(buckets.tolist())) == 8
    assert (bucket_of(ids, 8) == buckets).all() and bucket_of(ids.slice(3, 5), 8).tolist() == buckets[3:8].tolist()


@pytest.mark.parametrize("files, message", [
    ({"a.parquet": ["x", "y"], "b.parquet": ["z", "x"]}, r"1 duplicate id\(s\), e.g. 'x' \(in .*a.parquet and .*b.parquet\)"),
    ({"a.parquet": ["x", "y", "x"]}, r"1 duplicate id\(s\), e.g. 'x' \(in .*a.parquet\)"),
    ({"a.parquet": pa.array(["x", None, None])}, r"a.parquet: 2 row\(s\) have a null 'id' \(input.id_column\), first at row 1"),
    ({"a.parquet": [3, 1], "b.parquet": [2, 1]}, r"e.g. '1'"),
])
def test_check_ids_finds_duplicates_and_nulls(tmp_path, files, message):
    for name, ids in files.items():
        _shard(tmp_path / "in", name, id=ids, prompt=["p"] * len(ids))
    with pytest.raises(ConfigError, match=message):
        check_ids(inspect_inputs(InputConfig(paths=[str(tmp_path / "in")])))


def test_check_ids_accepts_unique_overlapping_ranges(tmp_path):
    _shard(tmp_path / "in", "a.parquet", id=["a", "m", "z"], prompt=["p"] * 3)
    _shard(tmp_path / "in", "b.parquet", id=["b", "n"], prompt=["p"] * 2)
    check_ids(inspect_inputs(InputConfig(paths=[str(tmp_path / "in")])))


# ---------------------------------------------------------------- read tasks

def test_a_corrupt_page_is_an_input_file_error_naming_file_and_row_group(tmp_path):
    _shard(tmp_path / "in", "a.parquet", id=[f"r{i}" for i in range(200)], prompt=[f"prompt {i}" * 30 for i in range(200)])
    path = tmp_path / "in" / "a.parquet"
    data = bytearray(path.read_bytes())
    for i in range(200, 1200):        # inside the data pages, well before the footer
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    plan = inspect_inputs(InputConfig(paths=[str(tmp_path / "in")]))    # footers only: preflight passes
    (task,) = row_group_tasks(plan, {plan.files[0]: None})
    with pytest.raises(InputFileError, match=r"a.parquet is corrupt \(row group 0 of 1\)") as caught:
        read_row_group(task, ReadSpec.of(plan), 1)
    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = caught.value
    assert input_error(wrapped).message == caught.value.message
    assert input_error(RuntimeError(f"ray said: {caught.value}\ntraceback")).message == caught.value.message


# ---------------------------------------------------------------- parts sized for storage

def test_part_writer_streams_blocks_into_parts_by_size_and_keeps_a_footer(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {})
    schema = output_schema([])
    writer = PartWriter(out, schema, ("/in/a", "/in/b"), 2, part_bytes=40_000, part_seconds=3600)
    committed = 0
    for block in range(40):                                   # 40 blocks of 16 rows (8 input rows x 2 samples)
        rows = np.repeat(np.arange(block * 8, block * 8 + 8), 2)
        table = to_output_table(pa.table({"id": [f"r{r}" for r in rows], "sample_index": np.tile([0, 1], 8),
                                          "finish_reason": ["stop"] * 16, "completion": ["x" * 100] * 16}), schema)
        # the engine's prefill counts of the block's batches (none in every fourth block: unknown)
        prefill = {"computed_tokens": 10, "prefix_cache_hit_tokens": 6} if block % 4 else None
        writer.add(table, np.full(16, block % 2), rows, np.tile([0, 1], 8), prefill=prefill)
        if writer.due():
            committed += writer.commit()
    assert 0 < len(out.part_files()) < 40 and not writer.seconds_left() is None
    committed += writer.commit()
    parts = out.part_files()
    assert committed == 640 and sum(pq.read_metadata(p).num_rows for p in parts) == 640
    footer = read_footer(parts[0], None)
    assert footer.stats["rows"] == footer.sources.num_rows == pq.read_metadata(parts[0]).num_rows
    done, total, _ = out.done()
    assert total["rows"] == 640 and done.merged()[1] == 0
    assert total["prefill"] == {"computed_tokens": 300, "prefix_cache_hit_tokens": 180}   # summed over 30 blocks
    assert statistics(total, 0, 0.0)["prefill"] == {"computed_tokens": 300, "prefix_cache_hit_tokens": 180,
                                                   "prefix_cache_hit_rate": 180 / 480,
                                                   "ideal_computed_tokens": None,     # no sketch in these blocks
                                                   "token_slots": None, "forward_token_slots": None}
    older = {k: v for k, v in total.items() if k != "prefill"}      # a footer written before the counts
    assert St.merge(older, total)["prefill"] == total["prefill"] and St.merge(older, older)["prefill"] is None
    assert statistics(St.merge(older, older), 0, 0.0)["prefill"]["computed_tokens"] is None
    left = done.pending(("/in/a", "/in/b"), (320, 320), 2)            # file a got the even blocks, b the odd
    assert left["/in/a"].samples(np.arange(16)).to_pylist() == [[]] * 8 + [[0, 1]] * 8
    assert left["/in/b"].samples(np.arange(16)).to_pylist() == [[0, 1]] * 8 + [[]] * 8
    aborted = PartWriter(out, schema, ("/in/a",), 1, part_bytes=1 << 30, part_seconds=3600)
    aborted.add(to_output_table(pa.table({"id": ["q"], "sample_index": [0]}), schema), np.zeros(1), np.zeros(1),
                np.zeros(1))
    aborted.abort()
    assert out.part_files() == parts and not list(out.tmp.iterdir())
    assert [f.name for f in OUTPUT_FIELDS][:2] == ["id", "sample_index"]
