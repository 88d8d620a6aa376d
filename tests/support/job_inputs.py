"""Builders for a job's inputs and config in a test's tmp dir, and file-system probes."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config_file import load_config
from pipeline.inputs.plan import inspect_inputs
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import read_file

MSG = '[{"role": "user", "content": "%s"}]'                                   # a messages cell, as JSON text
MSG_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def job_config(tmp_path: Path, model: Path, **sections):
    """A validated job config reading ``tmp_path/in`` and writing ``tmp_path/out``; ``sections``
    are merged into the config's sections (``sampling={"n": 2}``)."""
    data = {"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out")},
            "model": {"path": str(model)}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return load_config(None, data=data)


def write_shard(tmp_path: Path, name: str, **cols) -> Path:
    """``tmp_path/in/name`` as a Parquet file of ``cols`` (the input of ``job_config``)."""
    (tmp_path / "in").mkdir(parents=True, exist_ok=True)
    path = tmp_path / "in" / name
    pq.write_table(pa.table(cols), path)
    return path


def write_parquet(path: Path, **cols) -> None:
    """``cols`` as a Parquet file at ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)


def raw_strings(values: list[bytes | None]) -> pa.Array:
    """A string array holding arbitrary bytes: Arrow does not validate a binary -> string view."""
    return pa.array(values, pa.binary()).view(pa.string())


def tree_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with (size, mtime_ns): a before/after snapshot."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@contextmanager
def mounted(target: Path, *args: str):
    """``mount ARGS target`` for the block, unmounted after; skip the test where mounting is not allowed."""
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount on this machine: {r.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def preprocess_rows(cfg) -> list[dict]:
    """The job's CPU stage over the first input file of ``cfg``, as row dicts."""
    inputs = inspect_inputs(cfg.input)
    plan = PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling)
    return preprocess_batch(read_file(inputs, 0, cfg.sampling.n), plan).to_pylist()
