"""Object storage without Ray: URIs, inputs, the object-store output and lease, the model cache and
the exit-2 refusals, against a real S3-protocol server (moto's, on loopback; ``jobs/local_s3.py``)."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from jobs.local_s3 import iam_user, moto_server, upload
from support.paths import REPO
from support.racers import race
from support.hang import HANG_S

from pipeline.config import BehaviourConfig, ConfigError, InputConfig, ModelConfig, StorageConfig
from pipeline.storage.lease import LeaseHeld
from pipeline.storage.uris import glob_regex, locate



def _table(ids, **cols):
    return pa.table({"id": ids, "prompt": [f"def {i}():" for i in ids], **cols})


# ---------------------------------------------------------------- URIs and globs

def test_glob_regex_matches_what_glob_matches_on_a_local_tree(tmp_path):
    for rel in ["a.parquet", "b/c.parquet", "b/d/e.parquet", "b/x.txt", "f1.parquet", "f22.parquet", ".h.parquet",
                "b/.h/e.parquet", "b/.g.parquet", "b/xd/y.parquet", "^.parquet", "bz.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    files = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())
    for pattern in ["*.parquet", "**/*.parquet", "b/*.parquet", "b/**", "f?.parquet", "f[0-9]*.parquet",
                    "f[!1]*.parquet", "**/e.parquet", "**", "b/.*.parquet", "*/.h/*", "b/x**.parquet", "b**",
                    "[^a].parquet", "?.parquet", "b/[c-d]*", "b[/]c.parquet", "**/", "b/**/"]:
        full = f"{tmp_path}/{pattern}"
        want = sorted(p for p in glob.glob(full, recursive=True) if os.path.isfile(p))   # files only, as listed
        assert sorted(f for f in files if glob_regex(full).match(f)) == want, pattern


def test_uris_name_the_field_when_they_cannot_be_used():
    with pytest.raises(ConfigError, match=r"output.path: 'nosuch://x/y': no filesystem for the scheme 'nosuch'"):
        locate("nosuch://x/y", StorageConfig(), "output.path")
    with pytest.raises(ConfigError, match="input.paths.*names no bucket"):
        locate("s3:///key", StorageConfig(), "input.paths[0]")
    loc = locate("file:///tmp/../tmp/x", StorageConfig(), "output.path")
    assert loc.local and loc.path == os.path.realpath("/tmp/x")
    for bad, message in [("s3:/bkt/x", "looks like a URI without its '//'"), ("s3://bkt//x", "has an empty path component"),
                         ("s3://b*/x", "names no bucket")]:
        with pytest.raises(ConfigError, match=f"input.paths\\[0\\]: '{re.escape(bad)}' {message}"):
            locate(bad, StorageConfig(), "input.paths[0]")
    gcs = locate("gs://bkt/prefix/", StorageConfig(anonymous=True), "output.path")   # built, nothing fetched
    assert (gcs.uri, gcs.path, gcs.fs.type_name) == ("gs://bkt/prefix", "bkt/prefix", "gcs")


def test_schemes_pyarrow_lacks_go_through_fsspec_with_their_full_path(tmp_path):
    """``memory://`` (fsspec's in-process store) stands for any fsspec-only scheme: listing, globs,
    reading and the plan's filesystem all go through pyarrow's fsspec handler."""
    import fsspec

    from pipeline.inputs.plan import inspect_inputs

    mem = fsspec.filesystem("memory")
    for name, ids in {"a.parquet": ["a0", "a1"], "sub/b.parquet": ["b0"]}.items():
        with mem.open(f"/bkt/in/{name}", "wb") as f:
            pq.write_table(_table(ids), f)
    plan = inspect_inputs(InputConfig(paths=["memory://bkt/in"]))
    assert plan.files == ("/bkt/in/a.parquet", "/bkt/in/sub/b.parquet") and plan.num_rows == 3
    assert inspect_inputs(InputConfig(paths=["memory://bkt/in/*.parquet"])).files == ("/bkt/in/a.parquet",)
    assert locate("memory://bkt/in", StorageConfig(), "input.paths").uri == "memory:///bkt/in"


# ---------------------------------------------------------------- inputs on S3

def test_inputs_on_s3_prefixes_globs_files_and_hive_partitions(s3):
    from pipeline.inputs.plan import inspect_inputs

    fs = s3["fs"]
    for key, ids in {"in/a.parquet": ["a0", "a1"], "in/sub/b.parquet": ["b0"], "in/_tmp/skip.parquet": ["t"],
                     "in/.hidden.parquet": ["h"], "hive/lang=py/c.parquet": ["c0"], "hive/lang=go/d.parquet": ["d0"]
                     }.items():
        with fs.open_output_stream(f"bkt/{key}") as f:
            pq.write_table(_table(ids), f)
    plan = inspect_inputs(InputConfig(paths=["s3://bkt/in/"]), s3["storage"])
    assert plan.files == ("bkt/in/a.parquet", "bkt/in/sub/b.parquet") and plan.num_rows == 3
    assert plan.scheme == "s3" and plan.filesystem is not None
    assert inspect_inputs(InputConfig(paths=["s3://bkt/in/*.parquet"]), s3["storage"]).files == ("bkt/in/a.parquet",)
    assert inspect_inputs(InputConfig(paths=["s3://bkt/in/**/b.parquet"]), s3["storage"]).num_rows == 1
    hive = inspect_inputs(InputConfig(paths=["s3://bkt/hive"]), s3["storage"])
    assert hive.partition_columns == ("lang",) and hive.partition_base == "bkt/hive"
    with pytest.raises(ConfigError, match=r"input.paths\[0\] \('s3://bkt/nothing/'\): no such file or prefix"):
        inspect_inputs(InputConfig(paths=["s3://bkt/nothing/"]), s3["storage"])
    missing = r"input.paths\[0\].*cannot read s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist"
    with pytest.raises(ConfigError, match=missing):
        inspect_inputs(InputConfig(paths=["s3://no-such-bucket/x"]), s3["storage"])
    with pytest.raises(ConfigError, match="mixes filesystems"):
        inspect_inputs(InputConfig(paths=["s3://bkt/in/", str(REPO / "examples" / "shards")]), s3["storage"])


# ---------------------------------------------------------------- output: one PUT per part

def _sources(ids: list[str]):
    """Footer sources for rows with these ids: id 'a' is row 0 of one input file, 'b' row 1, ..."""
    import numpy as np

    from pipeline.output.sources import PartSources

    return PartSources(1, ("bkt/in/a.parquet",), np.array([[0, ord(i) - ord("a"), 1] for i in ids], np.int64))


def test_object_output_commits_reads_back_and_refuses_like_a_local_dir(s3):
    from pipeline.output.directory import OutputDir
    from pipeline.output.repair import dedupe, retry_errors

    loc = locate("s3://bkt/out1", s3["storage"], "output.path")
    ObjectOutputDir = lambda loc: OutputDir(loc.uri, s3["storage"])  # noqa: E731
    out = ObjectOutputDir(loc)
    out.check(BehaviourConfig(), ("bkt/in",), ("bkt/in/a.parquet",), "m", "s3")
    assert not s3["fs"].get_file_info(pafs.FileSelector("bkt/out1", allow_not_found=True))  # the probe: no trace
    out.prepare(BehaviourConfig(), {"model": "m"})
    rows = lambda ids, reason="stop": pa.table({"id": ids, "sample_index": [0] * len(ids),  # noqa: E731
                                                "finish_reason": [reason] * len(ids)})
    out.commit(rows(["a", "b"]), _sources(["a", "b"]))
    out.commit(rows(["c"], "error"), _sources(["c"]))
    out.commit(rows(["a"]), _sources(["a"]))                       # as if two jobs had written
    assert len(out.part_files()) == 3 and out.duplicates() == (1, "'a' (sample 0)")
    with pytest.raises(ConfigError, match="already holds output"):
        ObjectOutputDir(loc).check(BehaviourConfig(), (), (), "m", "s3")
    with pytest.raises(ConfigError, match="duplicate.*--dedupe"):
        ObjectOutputDir(loc).check(BehaviourConfig(resume=True), (), (), "m", "s3")
    with pytest.raises(ConfigError, match="inside the input"):
        ObjectOutputDir(loc).check(BehaviourConfig(), ("bkt",), (), "m", "s3")
    assert dedupe(out) == 1 and len(out.part_files()) == 2         # the emptied part is gone
    assert retry_errors(out) == 1
    assert sorted(out.read(["id"])["id"].to_pylist()) == ["a", "b"]
    assert out.done()[1]["rows"] == 2 and out.done()[1]["error"] == 0     # the footers were rewritten too
    retried = s3["fs"].get_file_info(pafs.FileSelector("bkt/out1/retried"))
    assert len(retried) == 1 and pq.read_table(retried[0].path, filesystem=s3["fs"])["id"].to_pylist() == ["c"]
    ObjectOutputDir(loc).check(BehaviourConfig(resume=True), (), (), "m", "s3")   # a clean resume is allowed
    other = s3["fs"]
    with other.open_output_stream("bkt/foreign/x.txt") as f:
        f.write(b"x")
    with pytest.raises(ConfigError, match="not an Orthrus output directory"):
        ObjectOutputDir(locate("s3://bkt/foreign", s3["storage"], "output.path")).check(
            BehaviourConfig(overwrite=True), (), (), "m", "s3")


# ---------------------------------------------------------------- the lease on an object store

_RACER = """
from pipeline.config import StorageConfig
from pipeline.storage.lease import LeaseHeld, take_lease
from pipeline.storage.uris import locate
loc = locate(sys.argv[3], StorageConfig(endpoint=sys.argv[4]), "output.path")
try:
    lease = take_lease(loc, "racer").acquire()
except LeaseHeld:
    print("refused", flush=True)
    sys.exit(0)
print("won", flush=True)
hold()                                       # until every racer has answered
print("won" if lease.verify() else "lost", flush=True)
lease.release()
"""


def test_of_jobs_racing_for_an_object_store_lease_exactly_one_wins(s3, tmp_path):
    for attempt in range(3):
        outcome = race(_RACER, [f"s3://bkt/race{attempt}", s3["endpoint"]], 6, tmp_path / f"gate{attempt}", cwd=REPO)
        assert outcome == ["refused"] * 5 + ["won"]


def test_object_lease_refuses_a_live_holder_takes_over_a_dead_one_and_stops_commits_when_lost(s3):
    from pipeline.storage.lease import check_free, take_lease
    from pipeline.output.directory import OutputDir, OutputWriteError

    loc = locate("s3://bkt/leased", s3["storage"], "output.path")
    first = take_lease(loc, "first")
    assert not s3["fs"].get_file_info(pafs.FileSelector("bkt/leased", allow_not_found=True))   # not taken yet
    with first:
        with pytest.raises(LeaseHeld, match="in use by another job: run first"):
            take_lease(loc, "second").acquire()
        with pytest.raises(LeaseHeld, match="in use by another job: run first"):
            check_free(loc)
    check_free(loc)
    # A holder killed without releasing: same host, its pid gone -> taken over at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"token": "t", "run_id": "dead", "host": os.uname().nodename, "pid": dead.pid, "heartbeat": time.time(),
             "state": "held"}
    with s3["fs"].open_output_stream("bkt/leased/_leases/t.json") as f:
        f.write(json.dumps(stale).encode())
    out = OutputDir(loc.uri, s3["storage"])
    out.lease = take_lease(loc, out.run_id).acquire()
    out.prepare(BehaviourConfig(), {})
    out.commit(pa.table({"id": ["a"], "sample_index": [0]}), _sources(["a"]))
    # Another live holder appears (a mistaken takeover elsewhere): this one commits nothing more.
    with s3["fs"].open_output_stream("bkt/leased/_leases/u.json") as f:
        f.write(json.dumps({**stale, "run_id": "other", "pid": os.getpid(), "token": "u"}).encode())
    with pytest.raises(OutputWriteError, match="lost the lease on output.path s3://bkt/leased"):
        out.commit(pa.table({"id": ["b"], "sample_index": [0]}), _sources(["b"]))
    assert len(out.part_files()) == 1
    out.lease.release()


# ---------------------------------------------------------------- the model cache

def test_model_is_downloaded_once_per_node_reused_and_refetched_when_it_changes(s3, tmp_path):
    from pipeline.storage.model_cache import MANIFEST
    from pipeline.storage.model_files import resolve_model_dir

    upload(s3["fs"], REPO / "models" / "tiny-orthrus-py", "bkt/models/tiny")
    storage = StorageConfig(endpoint=s3["endpoint"], model_cache_dir=str(tmp_path / "cache"))
    cfg = ModelConfig(path="s3://bkt/models/tiny")
    # Three processes at once (driver, preprocessing task, actor): one downloads, the others wait.
    script = ("import sys; from pipeline.config import ModelConfig, StorageConfig; "
              "from pipeline.storage.model_files import resolve_model_dir; "
              f"print(resolve_model_dir(ModelConfig(path='s3://bkt/models/tiny'), "
              f"StorageConfig(endpoint='{s3['endpoint']}', model_cache_dir='{tmp_path / 'cache'}')))")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=HANG_S)[0] for p in procs]
    assert sum("[orthrus] model s3://bkt/models/tiny: downloaded" in o for o in outputs) == 1, outputs
    local = Path(outputs[0].strip().splitlines()[-1])
    for f in (REPO / "models" / "tiny-orthrus-py").iterdir():
        assert (local / f.name).read_bytes() == f.read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in local.iterdir()}
    assert resolve_model_dir.__wrapped__(cfg, storage) == str(local)          # reused: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in local.iterdir()} == before
    with s3["fs"].open_output_stream("bkt/models/tiny/generation_config.json") as f:
        f.write(b'{"changed": true}')
    resolve_model_dir.__wrapped__(cfg, storage)
    assert json.loads((local / "generation_config.json").read_text()) == {"changed": True}
    assert json.loads((local / MANIFEST).read_text()).keys() == {p.name for p in local.iterdir()} - {MANIFEST}


def test_a_truncated_weights_object_is_refused_before_any_download(s3):
    from pipeline.storage.model_cache import check_remote_weight_headers

    upload(s3["fs"], REPO / "models" / "tiny-orthrus-py", "bkt/models/cut")
    data = (REPO / "models" / "tiny-orthrus-py" / "model.safetensors").read_bytes()
    with s3["fs"].open_output_stream("bkt/models/cut/model.safetensors") as f:
        f.write(data[: len(data) // 2])
    cut = r"model.safetensors in s3://bkt/models/cut is \d+ bytes but its header says \d+ \(truncated"
    with pytest.raises(ConfigError, match=cut):
        check_remote_weight_headers(locate("s3://bkt/models/cut", StorageConfig(endpoint=s3["endpoint"]),
                                           "model.path"))


# ---------------------------------------------------------------- exit status 2 before any model loads

def _generate(config: dict, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(config))
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run([sys.executable, "-m", "jobs.generate", "--config", str(path)], cwd=REPO,
                          env={**full, "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1", **env},
                          capture_output=True, text=True, timeout=HANG_S)


def test_bad_uri_missing_bucket_and_bad_credentials_exit_2_naming_the_field(tmp_path):
    with moto_server(enforce_auth_after=3) as endpoint:
        key, secret = iam_user(endpoint)                 # the 3 unauthenticated requests moto allows
        good = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
        fs = pafs.S3FileSystem(endpoint_override=endpoint.split("://")[1], scheme="http", region="us-east-1",
                      access_key=key, secret_key=secret, allow_bucket_creation=True)
        fs.create_dir("bkt")
        upload(fs, REPO / "examples" / "shards", "bkt/in")
        job = {"input": {"paths": ["s3://bkt/in/"]}, "output": {"path": "s3://bkt/out"},
               "model": {"path": str(REPO / "models" / "tiny-orthrus-py")}, "storage": {"endpoint": endpoint}}
        cases = [
            (job, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": "wrong"},              # wrong secret
             r"input.paths\[0\].*cannot read s3://bkt/in: .*ACCESS_DENIED"),
            (job, {}, r"input.paths\[0\].*cannot (list|read) s3://bkt/in"),                # no credentials
            ({**job, "output": {"path": "s3://missing-bucket/out"}}, good, r"output.path: cannot .*missing-bucket"),
            ({**job, "output": {"path": "gopher://x/y"}}, good, r"output.path: 'gopher://x/y': no filesystem"),
            ({**job, "model": {"path": "s3://bkt/no-model"}}, good, r"model.path: .*s3://bkt/no-model"),
        ]
        for config, env, message in cases:
            proc = _generate(config, tmp_path, env)
            assert proc.returncode == 2 and re.search(message, proc.stderr), (message, proc.stderr[-2000:])
            assert "Started a local Ray" not in proc.stdout + proc.stderr
        assert not [f for f in fs.get_file_info(pafs.FileSelector("bkt", recursive=True))
                    if f.path.startswith("bkt/out")]          # refused before anything was written


_CUT_SHORT = """
import os, sys
from jobs.local_s3 import s3fs
fs = s3fs(sys.argv[1])
f = fs.open_output_stream("bkt/cut/data/part-x.parquet")
f.write(os.urandom(12 << 20))         # past the first multipart chunk: parts are on the server
f.flush()
print("written", flush=True)
os._exit(9)                           # killed before the upload completes
"""


def test_an_upload_cut_short_never_becomes_a_part(s3):
    from pipeline.output.directory import OutputDir

    proc = subprocess.run([sys.executable, "-c", _CUT_SHORT, s3["endpoint"]], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 9 and "written" in proc.stdout, proc.stderr[-2000:]
    out = OutputDir("s3://bkt/cut", s3["storage"])
    assert out.part_files() == [] and out.done()[0].rows == 0
