"""The job's read operator (``pipeline/run/dataset.read_inputs``) on an in-process Ray: one block per
row group, not Ray Data's 200-block target reached by splitting each task's output (which fed the
actor 100-row blocks about 0.1 s apart, ``jobs.bench short``), and a row group bigger than the job's
block size still streams as several blocks."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.inputs.plan import inspect_inputs
from pipeline import schema as S


@pytest.fixture
def job_context(ray_local, monkeypatch):
    """The job's Ray Data settings for one test, restored after it (later modules share the process)."""
    import ray.data

    from pipeline.run.dataset import BLOCK_BYTES

    context = ray.data.DataContext.get_current()
    monkeypatch.setattr(context, "target_max_block_size", BLOCK_BYTES)
    monkeypatch.setattr(context, "enable_progress_bars", False)
    return BLOCK_BYTES


def _read(path, n: int = 1) -> list[pa.Table]:
    from pipeline.run.dataset import read_inputs

    inputs = inspect_inputs(InputConfig(paths=[str(path)], id_column="id"))
    ds = read_inputs(inputs, {inputs.files[0]: None}, n)
    return [b for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")]


def test_one_block_per_row_group_with_every_row(job_context, tmp_path):
    rows = 30
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": ["def f():"] * rows}),
                   tmp_path / "a.parquet", row_group_size=10)
    blocks = _read(tmp_path / "a.parquet", n=2)
    assert [b.num_rows for b in blocks] == [10, 10, 10]          # not split towards 200 blocks
    got = pa.concat_tables(blocks)
    assert sorted(got[S.ROW].to_pylist()) == list(range(rows))
    assert [len(s) for s in got[S.SAMPLES].to_pylist()] == [2] * rows


def test_a_row_group_larger_than_a_block_still_streams(job_context, tmp_path):
    rows, width = 3000, 1000                   # one 3 MB row group, three times the job's block size
    assert rows * width > 2 * job_context
    rng = np.random.default_rng(0)
    prompts = ["".join(chr(97 + c) for c in rng.integers(0, 26, width)) for _ in range(rows)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": prompts}), tmp_path / "big.parquet",
                   row_group_size=rows)
    blocks = _read(tmp_path / "big.parquet")
    assert len(blocks) >= 2
    assert sum(b.num_rows for b in blocks) == rows
