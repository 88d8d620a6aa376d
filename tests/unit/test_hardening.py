"""Hostile rows, extreme values and unusual column types, without Ray: each becomes an error row, its
limit, a lossless conversion, or a refusal naming the column and the file (up front with
``input.verify: full``, else by the file's read task).

The same inputs run end to end through a real Ray head in ``tests/e2e/test_hardening_ray.py``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.sampling import SamplingTensors, process
from pipeline.config import ConfigError
from pipeline.output.sources import PartSources
from pipeline.inputs.checks import verify_inputs
from pipeline.run.job import preflight
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import InputFileError, read_file
from support.hang import HANG_S
from support.hostile import hostile_rows
from support.job_inputs import job_config, write_shard



def test_hostile_rows_become_error_rows_and_extreme_values_their_limits(tmp_path, weightless_model):
    table, expected = hostile_rows()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "hostile.parquet")
    cfg = job_config(tmp_path, weightless_model, sampling={"n": 2})
    inputs = preflight(cfg).inputs
    out = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt,
                                                                               cfg.sampling))
    assert out.num_rows == 2 * table.num_rows                          # rows in x n == rows out
    for r in out.to_pylist():
        want = expected[r["id"]]
        if want is None:
            assert r["error"] is None and r["__request"]["prompt_token_ids"], r
        else:
            assert r["error"] and want in r["error"], (r["id"], r["error"])
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["tiny-temp"]["__request"]["temperature"] == 0.0         # its limit: greedy
    assert rows["tiny-top-p"]["__request"]["top_p"] == 1e-30            # its limit: the top token only


def test_extreme_sampling_values_behave_as_their_limits_in_the_engine(tiny_orthrus_dir):
    model = OrthrusForCausalLM.from_pretrained(str(tiny_orthrus_dir), dtype=torch.float32)
    engine = OrthrusEngine(model, max_batch_size=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    greedy = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=20))]
    for extreme in (SamplingParams(temperature=1e-300, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=1e-6, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=0.9, top_p=1e-300, max_new_tokens=20, seed=1),
                    SamplingParams(temperature=0.9, top_p=1e-40, max_new_tokens=20, seed=1)):
        assert [r.token_ids for r in engine.generate(prompts, extreme)] == greedy, extreme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_processing_never_yields_nan_probabilities(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 3, 500) * 40).to(dtype)
    logits[0, 0, 7] = torch.finfo(dtype).max                    # an extreme logit
    temps = [SamplingParams(temperature=t).temperature for t in (1e-300, 1e-5, 0.7, 1e30, 1e300, 0.0)]
    top_p = [SamplingParams(top_p=p).top_p for p in (1e-300, 1e-30, 0.5, 1.0, 1e-45, 1.0)]
    st = SamplingTensors(torch.tensor(temps, dtype=torch.float64), torch.tensor([0, 5, 0, 0, 1, 0]),
                         torch.tensor(top_p, dtype=torch.float64), torch.tensor([t == 0 for t in temps]),
                         filtered=True, all_greedy=False)
    probs = process(logits, st)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(6, 3, dtype=probs.dtype))


# ---------------------------------------------------------------- pass-through column types and hive partitions

def test_view_types_and_hive_partitions_pass_through(tmp_path, weightless_model):
    (tmp_path / "in" / "lang=en" / "year=2024").mkdir(parents=True)
    (tmp_path / "in" / "lang=fr" / "year=2025").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "v": pa.array(["s", "t"], pa.string_view()),
                             "lv": pa.array([[1], [2, 3]], pa.list_view(pa.int64())),
                             "bv": pa.array([b"x", b"y"], pa.binary_view())}),
                   tmp_path / "in" / "lang=en" / "year=2024" / "a.parquet")
    pq.write_table(pa.table({"id": ["c"], "prompt": ["r"]}), tmp_path / "in" / "lang=fr" / "year=2025" / "b.parquet")
    cfg = job_config(tmp_path, weightless_model)
    inputs = preflight(cfg).inputs
    assert inputs.passthrough == ("v", "lv", "bv", "lang", "year")
    assert [f.type for f in inputs.passthrough_fields] == [pa.string(), pa.list_(pa.int64()), pa.binary(),
                                                           pa.string(), pa.string()]
    plan = PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling)
    out = preprocess_batch(read_file(inputs, 0, 1), plan)                 # the read task sets the partition keys
    assert out.select(["v", "lv", "bv", "lang", "year"]).to_pylist() == [
        {"v": "s", "lv": [1], "bv": b"x", "lang": "en", "year": "2024"},
        {"v": "t", "lv": [2, 3], "bv": b"y", "lang": "en", "year": "2024"}]
    other = preprocess_batch(read_file(inputs, 1, 1), plan)               # a file without the view columns
    assert other.select(["id", "lang", "year"]).to_pylist() == [{"id": "c", "lang": "fr", "year": "2025"}]


@pytest.mark.parametrize("second, message", [
    (pa.array([0.5], pa.float64()), r"input column 'big' is int64 in .*a.parquet but double in another input file, "
                                    r"and a value here does not convert exactly"),
])
def test_a_column_that_cannot_be_carried_is_refused_up_front(tmp_path, weightless_model, second, message):
    write_shard(tmp_path, "a.parquet", id=["a", "b"], prompt=["p", "q"], big=pa.array([2 ** 60 + 1, 3], pa.int64()))
    write_shard(tmp_path, "b.parquet", id=["c"], prompt=["r"], big=second)
    inputs = preflight(job_config(tmp_path, weightless_model)).inputs    # footers only: the values are read later
    with pytest.raises(ConfigError, match=message):
        verify_inputs(inputs)                     # input.verify: full, before any actor loads the model
    with pytest.raises(InputFileError, match=message):
        read_file(inputs, 0, 1)                   # otherwise a.parquet's read task, mid-run (exit 2)
    assert read_file(inputs, 1, 1)["big"].to_pylist() == [0.5]        # the other file is carried


def test_a_partition_key_that_is_also_a_column_is_refused(tmp_path, weightless_model):
    (tmp_path / "in" / "lang=en").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "lang": ["de"]}), tmp_path / "in" / "lang=en" / "a.parquet")
    with pytest.raises(ConfigError, match=r"input column 'lang' is also a hive partition key in the path of"):
        preflight(job_config(tmp_path, weightless_model))


# ---------------------------------------------------------------- one writer per output directory

def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant(root, **info) -> None:
    import json

    root.mkdir(parents=True, exist_ok=True)
    (root / "_lease.json").write_text(json.dumps({"token": "old", "run_id": "r-old", "started": "then", **info}))


def test_a_live_lease_refuses_a_second_job_naming_it(tmp_path):
    from pipeline.config import StorageConfig
    from pipeline.storage.lease import LeaseHeld, check_free, take_lease
    from pipeline.storage.uris import locate

    lease = take_lease(tmp_path / "out", "run-1")
    assert not (tmp_path / "out").exists()                           # taken on entering the block, not before
    with lease:
        assert (tmp_path / "out" / "_lease.json").exists() and not lease.lost
        with pytest.raises(LeaseHeld, match=r"in use by another job: run run-1 \(pid \d+ on "):
            take_lease(tmp_path / "out", "run-2").acquire()
        with pytest.raises(LeaseHeld, match="run run-1"):
            check_free(tmp_path / "out")
        with pytest.raises(LeaseHeld, match="run run-1"):             # a local Location: the same lease file
            check_free(locate(str(tmp_path / "out"), StorageConfig(), "output.path"))
    assert not (tmp_path / "out" / "_lease.json").exists()          # released
    take_lease(tmp_path / "out", "run-3").acquire().release()        # and free again


@pytest.mark.parametrize("holder, stale", [
    ("dead pid on this host", True), ("reused pid on this host", True), ("live pid on this host", False),
    ("other host, old heartbeat", True), ("other host, fresh heartbeat", False)])
def test_stale_leases_are_taken_over_and_live_ones_are_not(tmp_path, capsys, holder, stale):
    import os
    import socket
    import time

    from pipeline.storage.lease import LeaseHeld, take_lease
    from pipeline.storage.lease_backends import pid_start

    here = socket.gethostname()
    info = {"dead pid on this host": dict(host=here, pid=_dead_pid(), heartbeat=time.time()),
            "reused pid on this host": dict(host=here, pid=os.getpid(), pid_start="1", heartbeat=time.time()),
            "live pid on this host": dict(host=here, pid=os.getpid(), pid_start=pid_start(os.getpid()),
                                          heartbeat=time.time()),
            "other host, old heartbeat": dict(host="elsewhere", pid=1, heartbeat=time.time() - 3600),
            "other host, fresh heartbeat": dict(host="elsewhere", pid=1, heartbeat=time.time())}[holder]
    _plant(tmp_path / "out", **info)
    if not stale:
        with pytest.raises(LeaseHeld, match="run r-old"):
            take_lease(tmp_path / "out", "new").acquire()
        return
    with take_lease(tmp_path / "out", "new"):
        assert "took over the stale lease of run r-old" in capsys.readouterr().out
    assert not list((tmp_path / "out").glob("_lease.json*"))


_RACER = """
from pipeline.storage.lease import LeaseHeld, take_lease
try:
    lease = take_lease(Path(sys.argv[3]), "racer").acquire()
except LeaseHeld:
    print("refused", flush=True)
    sys.exit(0)
print("won", flush=True)
hold()
lease.release()
"""


@pytest.mark.slow
@pytest.mark.parametrize("start", ["empty", "stale"])
def test_of_jobs_racing_for_a_lease_exactly_one_wins(tmp_path, start):
    import time

    from support.paths import TOKENIZER_DIR
    from support.racers import race

    if start == "stale":
        import socket
        _plant(tmp_path / "out", host=socket.gethostname(), pid=_dead_pid(), heartbeat=time.time())
    outcome = race(_RACER, [str(tmp_path / "out")], 6, tmp_path / "gate", cwd=TOKENIZER_DIR.parents[1])
    assert outcome == ["refused"] * 5 + ["won"]


def test_a_lost_lease_stops_commits(tmp_path, monkeypatch):
    import json
    import time

    from pipeline.storage import lease as L
    from pipeline.config import BehaviourConfig
    from pipeline.output.directory import OutputDir, OutputWriteError

    monkeypatch.setattr(L, "HEARTBEAT_S", 0.05)
    out = OutputDir(str(tmp_path / "out"))
    out.lease = L.take_lease(out.root, out.run_id).acquire()
    out.prepare(BehaviourConfig(), {})
    out.commit(pa.table({"id": ["a"], "sample_index": [0]}), PartSources(1, ("f",), np.array([[0, 0, 1]])))
    info = json.loads((out.root / "_lease.json").read_text())
    (out.root / "_lease.json").write_text(json.dumps({**info, "token": "someone else"}))   # a mistaken takeover
    deadline = time.time() + HANG_S
    while not out.lease.lost and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(OutputWriteError, match="lost the lease on output.path"):
        out.commit(pa.table({"id": ["b"], "sample_index": [0]}), PartSources(1, ("f",), np.array([[0, 1, 1]])))
    out.lease.release()
    assert (out.root / "_lease.json").exists()                        # not ours: left alone


def test_duplicates_are_refused_on_resume_and_dedupe_keeps_the_first_copy(tmp_path, weightless_model):
    import time

    from pipeline.config import BehaviourConfig
    from pipeline.output.directory import OutputDir
    from pipeline.output.repair import dedupe

    path = str(write_shard(tmp_path, "a.parquet", id=["a", "b", "c"], prompt=["p", "q", "r"]).resolve())
    row = {"a": 0, "b": 1, "c": 2}                                   # each id's row in a.parquet: its coordinate

    def commit(ids: list[str], completions: list[str]) -> None:
        flat = np.array([row[i] for i in ids])
        runs = np.stack([np.zeros(len(ids), np.int64), flat, np.ones(len(ids), np.int64)], axis=1)
        out.commit(pa.table({"id": ids, "sample_index": [0] * len(ids), "completion": completions}),
                   PartSources(1, (path,), runs))

    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {"model": str(weightless_model)})
    commit(["a", "b"], ["first-a", "first-b"])
    time.sleep(0.01)
    commit(["b", "c", "c"], ["second-b", "c1", "c2"])
    time.sleep(0.01)
    commit(["a"], ["third-a"])                                                               # a part of copies only
    with pytest.raises(ConfigError, match=r"holds 3 duplicate \(id, sample_index\) row\(s\), e.g. 'b' \(sample 0\)"
                                          r".*rerun with --dedupe"):
        preflight(job_config(tmp_path, weightless_model, behaviour={"resume": True}))
    prepared = preflight(job_config(tmp_path, weightless_model, behaviour={"resume": True, "dedupe": True}))
    prepared.out.prepare(prepared.config.behaviour, {"model": str(weightless_model)})
    assert dedupe(prepared.out) == 3
    rows = sorted((r["id"], r["completion"]) for r in prepared.out.read().to_pylist())
    assert rows == [("a", "first-a"), ("b", "first-b"), ("c", "c1")]
    assert dedupe(prepared.out) == 0 and prepared.out.duplicates() == (0, None)
    assert not list(prepared.out.tmp.iterdir())
    done, total, _ = prepared.out.done()                            # the footers say what the parts still hold
    assert done.rows == total["rows"] == 3 and done.pending((path,), (3,), 1) == {}


def test_a_column_the_writer_cannot_hold_is_refused_naming_column_and_file():
    from pipeline.inputs.column_types import check_group

    interval = pa.array([pa.scalar((1, 2, 3), pa.month_day_nano_interval()).as_py()], pa.month_day_nano_interval())
    group = pa.table({"id": ["a"], "when": interval})
    with pytest.raises(ConfigError, match=r"input column 'when' \(type month_day_nano_interval in f.parquet\) cannot "
                                          r"be carried to the output: ArrowNotImplementedError"):
        check_group(group, [pa.field("when", pa.month_day_nano_interval())], "f.parquet", first=True)


def test_retry_errors_moves_error_rows_out_of_data_keeping_each_key_once(tmp_path, weightless_model):
    from pipeline.config import BehaviourConfig
    from pipeline.output import stats as St
    from pipeline.output.directory import OutputDir
    from pipeline.output.repair import retry_errors

    out = OutputDir(str(tmp_path / "out"))
    out.prepare(BehaviourConfig(), {})
    f = "/in/f.parquet"                                            # ids a, b, c are its rows 0, 1, 2
    first = pa.table({"id": ["a", "b"], "sample_index": [0, 0], "finish_reason": ["stop", "error"]})
    prefill = {"computed_tokens": 7, "prefix_cache_hit_tokens": 5}          # the engine work of its batches
    out.commit(first, PartSources(1, (f,), np.array([[0, 0, 2]])), St.of_table(first, prefill))
    out.commit(pa.table({"id": ["c"], "sample_index": [0], "finish_reason": ["length"]}),
               PartSources(1, (f,), np.array([[0, 2, 1]])))
    assert retry_errors(out) == 1
    assert sorted(r["id"] for r in out.read().to_pylist()) == ["a", "c"]          # "b" will be generated again
    assert [r["id"] for r in pq.read_table(out.root / "retried").to_pylist()] == ["b"]
    done, total, _ = out.done()                                    # resume reads footers: only b's row is left
    assert total["rows"] == 2 and total["error"] == 0 and done.merged()[1] == 0
    assert total["prefill"] == prefill                             # the rewritten part keeps its counts
    assert done.pending((f,), (3,), 1)[f].samples(np.arange(3)).to_pylist() == [[], [0], []]
    assert retry_errors(out) == 0 and not list(out.tmp.iterdir())


def test_a_resume_with_another_configuration_is_refused_naming_the_changes(tmp_path, weightless_model):
    from pipeline.run.job import preflight as pre
    from pipeline.run.fingerprint import fingerprint

    write_shard(tmp_path, "a.parquet", id=["a"], prompt=["p"])
    first = job_config(tmp_path, weightless_model, sampling={"temperature": 0.0})
    prepared = pre(first)
    prepared.out.prepare(first.behaviour, {"model": str(weightless_model), "fingerprint": fingerprint(first)})
    same = job_config(tmp_path, weightless_model, sampling={"temperature": 0.0}, behaviour={"resume": True},
                   engine={"block_size": 4, "prefix_cache": False})            # engine settings may change
    pre(same)
    changed = job_config(tmp_path, weightless_model, sampling={"temperature": 0.7, "stop": ["x"]},
                      prompt={"chat_template": "off"}, behaviour={"resume": True})
    with pytest.raises(ConfigError, match=r"Changed: prompt.chat_template: 'auto' -> 'off'; sampling.stop: \[\] -> "
                                          r"\['x'\]; sampling.temperature: 0.0 -> 0.7\. .*--allow-config-change"):
        pre(changed)
    pre(job_config(tmp_path, weightless_model, sampling={"temperature": 0.7, "stop": ["x"]},
                prompt={"chat_template": "off"}, behaviour={"resume": True, "allow_config_change": True}))


def test_an_unreadable_lease_is_rewritten_by_its_holder_not_given_up(tmp_path, monkeypatch):
    import json
    import time

    from pipeline.storage import lease as L

    monkeypatch.setattr(L, "HEARTBEAT_S", 0.05)
    with L.take_lease(tmp_path / "out", "run-1") as lease:
        (tmp_path / "out" / "_lease.json").write_text("{ half a write")
        deadline = time.time() + HANG_S
        while time.time() < deadline:
            time.sleep(0.05)
            try:
                if json.loads((tmp_path / "out" / "_lease.json").read_text())["token"] == lease.token:
                    break
            except ValueError:
                continue
        assert not lease.lost and lease.verify()
        assert json.loads((tmp_path / "out" / "_lease.json").read_text())["token"] == lease.token
