"""The scale benchmark (jobs/bench/scale.py) runs end to end at a tiny size and reports every field it promises.

Speed and memory are never asserted (machines are shared and noisy); this guards the benchmark's
shape: the null stage's output contract, the synthetic committed output a resume starts from (its
footers leave exactly the last rows), a fresh run, and the commit path into a local directory and
an S3 endpoint. (The resume run itself is the same driver; ``python -m jobs.bench scale --sizes 2k``
runs it too, in about 30 s more.)
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from jobs import bench
from jobs.bench import scale as bench_scale
from jobs.bench.scale_data import swapped_blocks, write_committed, write_inputs



def test_null_stage_blocks_carry_the_output_contract():
    from pipeline import schema as S

    blocks = bench_scale.stage_blocks(2 * 2 * 64, files=2)
    assert [b.num_rows for b in blocks] == [64] * 4
    first = blocks[0]
    assert first[S.ROW].to_pylist() == list(range(64, 128))        # neighbouring blocks swapped
    assert set(first.column_names) >= {"id", "sample_index", "generated_text", "finish_reason", "num_generated_tokens",
                                       S.FILE, S.ROW, S.BATCH, "shard"}
    assert "__request" not in first.column_names
    records = first[S.BATCH].drop_null().to_pylist()
    assert len(records) == 1 and records[0]["rows"] == 64 and records[0]["started"] > 0
    assert set(first["finish_reason"].to_pylist()) == {"length"} and set(first["generated_text"].to_pylist()) == {""}
    out = S.to_output_table(first, S.output_schema([pa.field("shard", pa.int32())]))
    assert out.schema.names[:len(S.OUTPUT_NAMES)] == list(S.OUTPUT_NAMES)
    assert sorted(swapped_blocks(5, 2).tolist()) == list(range(5)) and swapped_blocks(5, 2).tolist()[:2] == [2, 3]
    assert np.array_equal(swapped_blocks(3, 1), [1, 0, 2])


def test_committed_output_footers_leave_exactly_the_last_rows(tmp_path):
    from pipeline.config import InputConfig
    from pipeline.output.directory import OutputDir
    from pipeline.inputs.plan import inspect_inputs

    inputs = write_inputs(tmp_path / "in", 4000, files=4)                 # 1000 rows per file
    out = OutputDir(str(write_committed(inputs, tmp_path / "out", left=300)))
    done, total, footers = out.done()
    plan = inspect_inputs(InputConfig(paths=[str(inputs)]))
    pending = done.pending(plan.files, plan.file_rows, 1)
    assert total["rows"] == done.rows == 3700 and total["finish_reason"] == {"length": 3700}
    assert list(pending) == [plan.files[-1]]                               # three files finished
    assert pending[plan.files[-1]].samples(np.arange(1000)).to_pylist() == [[]] * 700 + [[0]] * 300
    # blocks arrive out of order, but each row group is sorted by coordinate: a run per stretch of a file
    assert sum(len(f.sources.runs) for f in footers) <= 4 * len(footers)
    assert out.read(["id"])["id"].to_pylist()[:2] == ["f000-000000000", "f000-000000001"]


def test_bench_scale_smallest_size_runs(tmp_path):
    out = tmp_path / "scale.json"
    bench.main(["scale", "--sizes", "2k", "--resume-sizes", "", "--commit-rows", "2560", "--max-wall", "300",
                      "--cache", str(tmp_path / "cache"), "--out", str(out)])
    report = json.loads(out.read_text())
    fresh = report["fresh"]["2k"]
    assert fresh["complete"] and fresh["exit_status"] == 0 and fresh["rows_generated"] == 2000, fresh
    assert 0 < fresh["startup_s"] < fresh["wall_s"] and fresh["peak_rss_mb"] > 0 and fresh["parts_committed"] >= 1
    assert fresh["summary_s"] >= fresh["summary_plot_s"] > 0
    for where in ("local", "s3"):
        commit = report["commit_path"][where]
        assert commit["rows"] == 2560 and commit["parts"] == 1 and commit["rows_per_s"] > 0
    targets = report["targets"]
    assert set(targets) == {"commit_local_rows_per_s", "commit_s3_rows_per_s"}
    assert all(t["met"] in (True, False) for t in targets.values())
