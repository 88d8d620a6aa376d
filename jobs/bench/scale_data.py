"""Synthetic inputs and committed outputs for the scale workload (``scale.py``) (cached under a /tmp dir).

Inputs: ``FILES`` Parquet files of one-line prompts with an ``id`` column (``f<file>-<row>``, zero
padded, so files hold disjoint id ranges as sharded inputs do) and a small pass-through column,
written in row groups of ``ROW_GROUP`` rows with a ``ParquetWriter`` (memory bounded by one group).

Committed outputs (the state ``--resume`` starts from): every row of every input file except the
last ``left`` rows of the last file, committed through the job's own writer (``OutputDir`` +
``PartWriter`` at the default ``output.part_bytes``) as the rows :class:`jobs.bench.scale.NullStage`
returns, so each part's footer holds real sources and aggregates. Rows are added in 64-row blocks
with each pair of neighbouring blocks swapped (as actors return batches out of order), so a footer
holds one run per block, as a real run's does, not one run per file.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "models" / "tiny-orthrus-py")
FILES = 20
ROW_GROUP = 100_000
BLOCK = 64
_CHUNK = 1024 * BLOCK       # rows per add() when building a committed output
INPUT_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("shard", pa.int32())])


def ids_of(file: int, rows: np.ndarray) -> pa.Array:
    """The ids of ``rows`` of input file ``file`` (vectorised)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(rows, pa.int64()), pa.string()), 9, "0")
    return pc.binary_join_element_wise(f"f{file:03d}-", digits, "")


def _complete(dest: Path) -> Path:
    return dest.with_name(dest.name + ".complete")


def write_inputs(dest: Path, rows: int, files: int = FILES) -> Path:
    """``rows`` input rows in ``files`` files under ``dest`` (reused when already complete)."""
    if _complete(dest).exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        with pq.ParquetWriter(dest / f"shard-{f:03d}.parquet", INPUT_SCHEMA) as writer:
            for lo in range(0, per, ROW_GROUP):
                ids = ids_of(f, np.arange(lo, min(per, lo + ROW_GROUP)))
                prompt = pc.binary_join_element_wise("Write one line about item ", ids, ".", "")
                writer.write_table(pa.table({"id": ids, "prompt": prompt,
                                             "shard": pa.array(np.full(len(ids), f, np.int32))}, INPUT_SCHEMA),
                                   row_group_size=ROW_GROUP)
    _complete(dest).touch()
    return dest


def job_config(inputs: Path, out: Path | str, resume: bool = False, max_wall: float | None = None) -> dict:
    """The benchmark's job config (the bundled tokenizer; one CPU actor, one CPU left for tasks)."""
    return {"input": {"paths": [str(inputs)]}, "output": {"path": str(out)}, "model": {"path": MODEL},
            "prompt": {"chat_template": "off"}, "sampling": {"max_new_tokens": 16},
            "engine": {"batch_size": BLOCK}, "resources": {"replicas": 1, "cpus_per_replica": 1},
            "behaviour": {"resume": resume, "max_wall_seconds": max_wall}}


def swapped_blocks(n: int, block: int = BLOCK) -> np.ndarray:
    """A permutation of ``range(n)`` that swaps each pair of neighbouring ``block``-row blocks."""
    blocks = -(-n // block)
    order = np.arange(blocks)
    even = blocks - blocks % 2
    order[:even] = order[:even].reshape(-1, 2)[:, ::-1].ravel()
    index = (order[:, None] * block + np.arange(block)).ravel()
    return index[index < n]


def finished_rows(file: int, rows: np.ndarray, model: str = MODEL) -> pa.Table:
    """What the null stage returns for ``rows`` of ``file`` (before the cast to the output schema)."""
    n = len(rows)
    return pa.table({"id": ids_of(file, rows), "sample_index": pa.array(np.zeros(n, np.int64)),
                     "completion": pa.repeat(pa.scalar(""), n), "finish_reason": pa.repeat(pa.scalar("length"), n),
                     "num_prompt_tokens": pa.array(np.full(n, 8, np.int64)),
                     "num_completion_tokens": pa.array(np.zeros(n, np.int64)),
                     "model": pa.repeat(pa.scalar(model), n), "shard": pa.array(np.full(n, file, np.int32))})


def write_committed(inputs: Path, dest: Path, left: int = 1000) -> Path:
    """A committed output of ``inputs`` with only the last ``left`` rows of the last file missing
    (reused when already complete; copy it before resuming into it)."""
    from pipeline.config_file import load_config
    from pipeline.output.directory import OutputDir
    from pipeline.output.parts import PartWriter
    from pipeline.inputs.plan import inspect_inputs
    from pipeline.schema import output_schema, to_output_table
    from pipeline.run.fingerprint import fingerprint

    if _complete(dest).exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    cfg = load_config(None, data=job_config(inputs, dest))
    plan = inspect_inputs(cfg.input, cfg.storage)
    out = OutputDir(str(dest), cfg.storage)
    out.prepare(cfg.behaviour, {"model": cfg.model.path, "fingerprint": fingerprint(cfg),
                                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    schema = output_schema(plan.passthrough_fields)
    writer = PartWriter(out, schema, plan.files, 1, cfg.output.part_bytes, 1e12)   # parts by size only
    last = len(plan.files) - 1
    for f, count in enumerate(plan.file_rows):
        stop = max(0, count - left) if f == last else count
        for lo in range(0, stop, _CHUNK):
            rows = np.arange(lo, min(stop, lo + _CHUNK))[swapped_blocks(min(stop, lo + _CHUNK) - lo)]
            table = to_output_table(finished_rows(f, rows, cfg.model.path), schema)
            writer.add(table, np.full(len(rows), f, np.int64), rows, np.zeros(len(rows), np.int64))
            if writer.due():
                writer.commit()
    writer.commit()
    _complete(dest).touch()
    return dest


def copy_output(src: Path, dest: Path) -> Path:
    """A copy of a committed output to resume into: parts hard-linked (a resume adds parts and
    replaces top-level files by rename, never writes into a part), the rest copied."""
    shutil.copytree(src, dest, copy_function=_link)
    return dest


def _link(src: str, dst: str) -> None:
    try:
        Path(dst).hardlink_to(src)
    except OSError:
        shutil.copy2(src, dst)
