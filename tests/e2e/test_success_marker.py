"""The completion marker ``<output>/_SUCCESS`` without Ray, on a local directory and on the local
S3 server: written only for a complete output, holding the run's figures; removed by every run start
(resume, repair, overwrite); an output holding one is still ours to resume.

End to end (a complete job, a ``max_wall_seconds`` stop, ``--resume``, ``--retry-errors``) in
``tests/e2e/test_observability_ray.py`` and, on S3, ``tests/e2e/test_storage_ray.py``.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import BehaviourConfig
from pipeline.output.directory import SUCCESS, OutputDir
from pipeline.output.sources import PartSources
from pipeline.output.success import mark_complete
from pipeline.report.summary import summarize


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path) -> tuple[str, object]:
    """(output path, storage config) on a local directory or on the local S3 server."""
    if request.param == "local":
        return str(tmp_path / "out"), None
    server = request.getfixturevalue("s3")
    return f"s3://bkt/success-{tmp_path.name}", server["storage"]


def _commit(out: OutputDir, rows: list[int]) -> None:
    """Commit rows ``rows`` of one 3-row input file (sample 0 of n = 1)."""
    table = pa.table({"id": [f"r{i}" for i in rows], "sample_index": [0] * len(rows),
                      "finish_reason": ["stop"] * len(rows), "num_completion_tokens": [5] * len(rows)})
    out.commit(table, PartSources(1, ("/in/f.parquet",), np.array([[0, i, 1] for i in rows], np.int64)))


def _summary(out: OutputDir, expected: int = 3) -> dict:
    run = {"run_id": out.run_id, "input_rows": 3, "samples_per_row": 1, "rows_expected": expected, "rows_generated": 3,
           "rows_skipped_as_finished": 0, "wall_seconds": 2.0, "tokens_per_second": 7.5,
           "cost": {"device": "cpu", "device_days_per_billion_output_tokens": 1.5}}
    return summarize(out, run, {})


def test_written_only_when_complete_with_the_runs_figures_and_removed_by_every_start(where):
    path, storage = where
    out = OutputDir(path, storage)
    out.prepare(BehaviourConfig(), {"model": "m"})
    _commit(out, [0, 1])
    assert not mark_complete(out, _summary(out)) and not out.success_exists     # 2 of 3 rows: no marker
    _commit(out, [2])
    assert mark_complete(out, _summary(out)) and out.success_exists
    record = json.loads(out.store.read_bytes(out.store.path(SUCCESS)))
    assert record["run_id"] == out.run_id and record["output"] == str(out.root)
    assert {k: record["rows"][k] for k in ("input_rows", "samples_per_row", "expected", "in_output", "ok", "error")} \
        == {"input_rows": 3, "samples_per_row": 1, "expected": 3, "in_output": 3, "ok": 3, "error": 0}
    assert record["tokens"]["completion"] == 15 and record["cost"]["device_days_per_billion_output_tokens"] == 1.5

    for behaviour in (BehaviourConfig(resume=True), BehaviourConfig(resume=True, retry_errors=True),
                      BehaviourConfig(resume=True, dedupe=True), BehaviourConfig(overwrite=True)):
        again = OutputDir(path, storage)
        again.check(behaviour, (), (), "m")            # a finished output is still ours to resume or replace
        assert again.success_exists
        again.prepare(behaviour, {"model": "m"})       # what every run does first
        assert not again.success_exists, behaviour
        if not behaviour.overwrite:
            assert mark_complete(again, _summary(again))   # complete again: the new run's marker
            assert json.loads(again.store.read_bytes(again.store.path(SUCCESS)))["run_id"] == again.run_id


def test_a_duplicate_row_is_not_complete(where):
    path, storage = where
    out = OutputDir(path, storage)
    out.prepare(BehaviourConfig(), {"model": "m"})
    _commit(out, [0, 1, 2])
    _commit(out, [1])                                  # as if two jobs had written: 4 rows, one twice
    summary = _summary(out, expected=4)                # the row count alone would say complete
    assert summary["rows"]["duplicate_keys"] == 1 and not summary["run"]["complete"]
    assert not mark_complete(out, summary) and not out.success_exists
