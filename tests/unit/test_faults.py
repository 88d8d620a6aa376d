"""Faults and security without a Ray cluster: unwritable or full output, planted code, hostile config.

Write failures are real: a path under a regular file (fails even for root), a read-only bind mount
and a tiny tmpfs that really fills up (both skipped where this machine cannot mount).
"""
from __future__ import annotations

import asyncio

import json
import os
import pickle
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from pipeline.config import BehaviourConfig, ConfigError
from pipeline.config_file import load_config
from pipeline.run.job import preflight
from pipeline.output.directory import OutputDir, OutputWriteError
from pipeline.output.sources import PartSources
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.schema import output_schema, to_output_table
from pipeline.inputs.source import read_file
from pipeline.actor.stage import GenerationStage, StagePlan
from support.job_inputs import job_config, mounted, tree_snapshot, write_shard


@contextmanager
def read_only(target: Path):
    """``target`` as a read-only bind mount of a fresh directory (root cannot write there either)."""
    src = target.with_name(target.name + "-src")
    src.mkdir()
    with mounted(target, "--bind", str(src)):
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        yield target


# ---------------------------------------------------------------- output dir not writable / disk full

def test_unwritable_output_fails_before_anything_runs(tmp_path, weightless_model, capsys):
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["p"])
    (tmp_path / "file").write_text("a regular file")
    job = tmp_path / "job.yaml"
    cfg = {"input": {"paths": [str(tmp_path / "in")]}, "model": {"path": str(weightless_model)}}
    job.write_text(json.dumps({**cfg, "output": {"path": str(tmp_path / "file" / "out")}}))
    assert main(["--config", str(job)]) == 2  # exit 2: rejected before Ray or the model started
    assert "output.path" in (err := capsys.readouterr().err) and "is not writable: Not a directory" in err
    with read_only(tmp_path / "ro"):
        with pytest.raises(ConfigError, match=r"ro/deep/out is not writable: Read-only file system"):
            preflight(job_config(tmp_path, weightless_model, output={"path": str(tmp_path / "ro" / "deep" / "out")}))
        assert not list((tmp_path / "ro").iterdir())
    before = tree_snapshot(tmp_path)
    preflight(job_config(tmp_path, weightless_model, output={"path": str(tmp_path / "new" / "deep" / "out")}))
    assert tree_snapshot(tmp_path) == before  # the write probe leaves no trace


INPUT = "/in/f.parquet"


def _part(rows: int, seed: int) -> tuple[pa.Table, PartSources]:
    """A part of incompressible completions (fills a small disk quickly): rows ``seed * rows`` to
    ``(seed + 1) * rows`` of one input file (n = 1), and its sources."""
    text = [os.urandom(64).hex() for _ in range(rows)]
    t = pa.table({"id": [f"{seed}-{i}" for i in range(rows)], "sample_index": [0] * rows, "completion": text,
                  "finish_reason": ["length"] * rows})
    return to_output_table(t, output_schema([])), PartSources(1, (INPUT,), np.array([[0, seed * rows, rows]]))


def test_disk_full_commit_leaves_only_complete_parts(tmp_path):
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=96k", "tmpfs"):
        out = OutputDir(str(tmp_path / "small" / "out"))
        out.prepare(BehaviourConfig(), {"model": "m"})
        with pytest.raises(OutputWriteError) as err:
            for seed in range(100):
                out.commit(*_part(200, seed))
        msg = str(err.value)
        assert "No space left on device" in msg and "--resume" in msg and f"{out.committed} part file(s)" in msg
        assert out.committed >= 1 and not list(out.tmp.iterdir())  # no half-written file anywhere
        parts = out.part_files()
        assert len(parts) == out.committed and all(pq.read_table(p).num_rows == 200 for p in parts)
        keys = out.read(["id"])["id"].to_pylist()
        assert len(keys) == len(set(keys)) == 200 * out.committed
        done, total, _ = out.done()    # what resume would skip (footers): exactly the committed rows, once each
        merged, twice = done.merged()
        assert twice == 0 and done.rows == total["rows"] == 200 * out.committed
        assert merged[(INPUT, 1)].tolist() == [[0, 200 * out.committed]]
        assert done.pending((INPUT,), (200 * out.committed,), 1) == {}     # an input of just those rows: finished
        more = 200 * (out.committed + 1)                                   # one part longer: only the rest is left
        left = done.pending((INPUT,), (more,), 1)[INPUT].samples(np.arange(more)).to_pylist()
        assert [row for row, samples in enumerate(left) if samples] == list(range(200 * out.committed, more))


def test_disk_full_at_start_is_a_clear_error(tmp_path, weightless_model):
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["p"])
    with mounted(tmp_path / "full", "-t", "tmpfs", "-o", "size=8k", "tmpfs"):
        (tmp_path / "full" / "filler").write_bytes(b"\0" * 8192)
        with pytest.raises(ConfigError, match=r"full/out is not writable: No space left on device"):
            preflight(job_config(tmp_path, weightless_model, output={"path": str(tmp_path / "full" / "out")}))
        assert [p.name for p in (tmp_path / "full").iterdir()] == ["filler"]


# ---------------------------------------------------------------- nothing written outside the output dir

@pytest.mark.parametrize("link", ["_tmp", "data"])
def test_planted_symlink_in_output_dir_is_refused(tmp_path, weightless_model, link):
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["p"])
    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {"model": str(weightless_model)})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(tmp_path / "out" / link)
    (tmp_path / "out" / link).symlink_to(elsewhere)
    for behaviour in ({"resume": True}, {"overwrite": True}):
        with pytest.raises(ConfigError, match=f"{link} is a symbolic link; refusing"):
            preflight(job_config(tmp_path, weightless_model, behaviour=behaviour))
    assert elsewhere.is_dir() and not list(elsewhere.iterdir())


# ---------------------------------------------------------------- a checkpoint is data, never code

_EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('code from the checkpoint ran')\n"


class _Pickled:
    """Unpickling this creates the marker file: a planted pytorch_model.bin must never be loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pickle from the checkpoint ran"))


def test_planted_code_in_checkpoint_is_never_executed(tmp_path, tiny_orthrus_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_orthrus_dir, model)
    marker = tmp_path / "PWNED"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py"):
        (model / name).write_text(_EVIL.format(marker=str(marker)))
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Pickled(str(marker))))
    for name, auto_map in (("config.json", {"AutoConfig": "configuration_evil.EvilConfig",
                                            "AutoModelForCausalLM": "modeling_evil.EvilModel"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})):
        cfg = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**cfg, "auto_map": auto_map}))
    write_shard(tmp_path, "a.parquet", id=["x"], prompt=["def f(x):"])
    cfg = job_config(tmp_path, model, sampling={"max_new_tokens": 3})
    inputs = preflight(cfg).inputs  # loads the tokenizer
    batch = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt,
                                                                                 cfg.sampling))
    stage = GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False))
    row = asyncio.run(stage(batch)).to_pylist()[0]
    assert row["error"] is None and row["num_generated_tokens"] >= 1
    assert not marker.exists()


# ---------------------------------------------------------------- config: unknown keys, no code in YAML

@pytest.mark.parametrize("section", ["input", "output", "model", "prompt", "sampling", "engine", "resources",
                                     "behaviour"])
def test_every_config_section_rejects_unknown_keys(section):
    data = {"input": {"paths": ["i"]}, "output": {"path": "o"}, "model": {"path": "m"}}
    data[section] = {**data.get(section, {}), "fault_inject": "oom_if_batch_gt:1"}
    with pytest.raises(ConfigError, match=rf"  {section}.fault_inject: unknown field"):
        load_config(None, data=data)


def test_yaml_cannot_construct_objects(tmp_path):
    marker = tmp_path / "PWNED"
    payload = f"!!python/object/apply:os.system ['touch {marker}']"
    bad = tmp_path / "job.yaml"
    bad.write_text(f"input: {{paths: [a]}}\noutput: {{path: o}}\nmodel: {{path: {payload}}}\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="model.path=.*the value is not valid YAML"):
        load_config(None, [f"model.path={payload}"], data={"input": {"paths": ["a"]}, "output": {"path": "o"}})
    assert not marker.exists()
