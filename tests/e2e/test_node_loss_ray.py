"""Node loss on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster`` on this machine).

The cluster has a CPU head (no GPU) and two workers with one *logical* GPU each, so the two
generation actors (``resources.gpus_per_replica: 1``) run on the workers (on the CPU device: there is
no CUDA) and the driver (``python -m jobs.generate --address ...``) attaches to the head. Each actor
runs two batches, then holds the rest until the test creates a gate file
(``ORTHRUS_FAULT_INJECT=hold_after:2:GATE``), so the job is still running when a node is killed
however fast or loaded the machine: the test releases it only after the kill.

- a worker lost without grace mid-run, and a replacement worker added: the job finishes by itself
  (exit 0) with every (id, sample_index) exactly once and no error rows;
- the head (the driver's node) lost without grace mid-run: the driver is SIGKILLed if it does not
  end by itself, the cluster is torn down, and the same command with ``--resume`` on a new cluster
  completes the output, every key exactly once.

The cluster lives in a helper process of its own session (``CLUSTER_HELPER`` below) that holds the
``Cluster`` and obeys one-word commands on stdin: nothing Ray-global (node SIGTERM/atexit hooks,
``setpgrp``, GCS state) lands in the pytest process, and a failed test still SIGKILLs the helper's
whole process group (every Ray process of that cluster) by the helper's own pid. Each cluster has
its own short temp dir, lets the OS pick every port, runs no dashboard, and does not write
``/tmp/ray/ray_current_cluster`` (which a later ``ray.init()`` without an address would follow to a
dead or foreign cluster).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support.paths import REPO
from support.hang import HANG_S
from support.ray_head import killpg


VENV_BIN = Path(sys.executable).parent

ROWS = 40                 # one shard; batch_size 2 -> 20 batches, 8 in flight at a time (2 actors x 4)
HOLD_AFTER = 2            # batches each actor runs before it waits for the gate (ORTHRUS_FAULT_INJECT=hold_after)
JOB_TIMEOUT = HANG_S      # seconds a job may take before the test calls it a hang (support.ray_head)
HEAD_LOSS_GRACE = 20      # seconds a driver whose head died may take to end by itself (then SIGKILL)
GCS_RECONNECT_S = 5       # the driver's RAY_gcs_rpc_server_reconnect_timeout_s in that test (Ray's default: 60)

# The helper that holds a Cluster. argv[1]: {"temp_dir": ...}. Replies are single lines starting with
# "@@ " (anything else on its stdout is Ray's noise and is skipped).
CLUSTER_HELPER = r"""
import json, sys
import ray._private.utils
ray._private.utils.write_ray_address = lambda *a, **k: None   # no /tmp/ray/ray_current_cluster
from ray.cluster_utils import Cluster

spec = json.loads(sys.argv[1])
common = {"temp_dir": spec["temp_dir"], "object_store_memory": 100 * 1024 * 1024}
cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                  head_node_args={**common, "num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
workers = []

def reply(**kw):
    print("@@ " + json.dumps(kw), flush=True)

def add_worker():
    node = cluster.add_node(**common, num_cpus=1, num_gpus=1)
    workers.append(node)
    return node.node_id

for _ in range(2):
    add_worker()
cluster.wait_for_nodes()
reply(gcs=cluster.address, head=cluster.head_node.node_id, workers=[w.node_id for w in workers])
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "remove_worker":
        node = workers.pop(0)
        cluster.remove_node(node, allow_graceful=False)
        reply(removed=node.node_id)
    elif cmd == "add_worker":
        reply(added=add_worker())
    elif cmd == "kill_head":
        node = cluster.head_node
        cluster.remove_node(node, allow_graceful=False)
        reply(killed=node.node_id)
    elif cmd == "shutdown":
        break
for node in list(cluster.worker_nodes):
    cluster.remove_node(node, allow_graceful=False)
if cluster.head_node is not None:
    cluster.remove_node(cluster.head_node, allow_graceful=False)
reply(stopped=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


class SimCluster:
    """One simulated cluster (head + 2 GPU workers) in a helper process; see the module docstring."""

    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")   # short: Ray's socket paths stay < 108 chars
        self._log = open(Path(self.temp) / "helper.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", CLUSTER_HELPER, json.dumps({"temp_dir": self.temp})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=_env(),
                                     cwd=self.temp, start_new_session=True, bufsize=0)   # unbuffered: select()
        self.stopped = False
        info = self._reply(timeout=HANG_S)
        self.gcs, self.head, self.workers = info["gcs"], info["head"], info["workers"]

    def log_tail(self, n: int = 3000) -> str:
        return (Path(self.temp) / "helper.log").read_text(errors="replace")[-n:]

    def _reply(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise AssertionError(f"cluster helper: no reply in {timeout:g} s\n{self.log_tail()}")
            line = self.proc.stdout.readline().decode()
            if not line:
                raise AssertionError(f"cluster helper exited ({self.proc.poll()})\n{self.log_tail()}")
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def command(self, cmd: str, timeout: float = 90) -> dict:
        self.proc.stdin.write(f"{cmd}\n".encode())
        self.proc.stdin.flush()
        return self._reply(timeout)

    def shutdown(self) -> None:
        """Stop every node (without grace), then the helper; SIGKILL its process group if that fails."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if self.proc.poll() is None:
                self.command("shutdown", timeout=60)
                self.proc.wait(timeout=30)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            killpg(self.proc, grace=5)     # the helper's session: every Ray process it started
            self._log.close()
            shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def clusters():
    """A factory of simulated clusters; every one is shut down at the end of the test, pass or fail."""
    started: list[SimCluster] = []

    def start() -> SimCluster:
        started.append(SimCluster())
        return started[-1]

    yield start
    for c in started:
        c.shutdown()


class Job:
    """``python -m jobs.generate --config FILE --address GCS [args]`` in its own session, output to files."""

    def __init__(self, cfg: Path, gcs: str, *args: str, name: str = "job", env: dict[str, str] | None = None) -> None:
        self.out = cfg.parent / f"{name}.stdout"
        self.err = cfg.parent / f"{name}.stderr"
        self.gate = cfg.parent / "gate"     # the test creates it to let the held batches go
        env = _env(ORTHRUS_FAULT_INJECT=f"hold_after:{HOLD_AFTER}:{self.gate}", **(env or {}))
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", "--config", str(cfg),
                                          "--address", gcs, *args], cwd=REPO, env=env, stdout=o, stderr=e,
                                         start_new_session=True)
        self.t0 = time.time()

    def tail(self, n: int = 4000) -> str:
        return (f"--- stdout ---\n{self.out.read_text(errors='replace')[-n:]}\n"
                f"--- stderr ---\n{self.err.read_text(errors='replace')[-n:]}")

    def wait(self, timeout: float = JOB_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job still running after {timeout} s (hang?)\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL the driver by its own pid (then reap it: a zombie's pid would still hold the lease)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            killpg(self.proc, grace=3)


@pytest.fixture
def jobs():
    """A factory of job drivers; any still running at the end of the test is killed."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        started.append(Job(*args, **kwargs))
        return started[-1]

    yield start
    for j in started:
        j.cleanup()


def _job_config(tmp_path: Path, model: Path) -> tuple[Path, list[tuple[str, int]]]:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(ROWS)], "prompt": [f"def r{i}(a):" for i in range(ROWS)]}),
                   tmp_path / "in" / "s0.parquet")
    # output.part_bytes: 1 commits a part per batch, so parts appear while the job runs (the default
    # 128 MiB / 60 s part would commit this whole job at its end).
    cfg = {"input": {"paths": [str(tmp_path / "in")]}, "output": {"path": str(tmp_path / "out"), "part_bytes": 1},
           "model": {"path": str(model)}, "prompt": {"chat_template": "off"},
           "sampling": {"max_new_tokens": 4},
           "engine": {"batch_size": 2, "max_batch_size": 4, "max_seq_len": 64},
           "resources": {"gpus_per_replica": 1, "replicas": 2, "cpus_per_replica": 1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, sorted((f"r{i}", 0) for i in range(ROWS))


def _parts(out: Path) -> list[Path]:
    return sorted((out / "data").glob("*.parquet"))


def _rows(out: Path) -> list[dict]:
    return [r for f in _parts(out)
            for r in pq.read_table(f, columns=["id", "sample_index", "finish_reason", "error"]).to_pylist()]


def _wait_for_part(job: Job, out: Path, timeout: float = HANG_S) -> int:
    """Wait until the running job has committed a part → how many parts there are then."""
    deadline = time.time() + timeout
    while not (n := len(_parts(out))):
        assert job.proc.poll() is None, f"job ended ({job.proc.returncode}) before committing a part\n{job.tail()}"
        assert time.time() < deadline, f"no part committed in {timeout} s\n{job.tail()}"
        time.sleep(0.1)
    return n


def _check_exactly_once(out: Path, expected: list[tuple[str, int]], log: str) -> None:
    rows = _rows(out)
    keys = sorted((r["id"], r["sample_index"]) for r in rows)
    dup = sorted({k for k in keys if keys.count(k) > 1})
    missing = sorted(set(expected) - set(keys))
    assert not dup and not missing and keys == expected, \
        f"{len(rows)} rows out for {len(expected)} in; duplicated {dup}; missing {missing}\n{log}"
    errors = [r for r in rows if r["finish_reason"] == "error" or r["error"] is not None]
    assert not errors, f"error rows: {errors[:5]}\n{log}"


def test_worker_lost_mid_run_and_replaced_every_row_exactly_once(clusters, jobs, tiny_orthrus_dir, tmp_path):
    cfg, expected = _job_config(tmp_path, tiny_orthrus_dir)
    out = tmp_path / "out"
    cluster = clusters()
    job = jobs(cfg, cluster.gcs)
    parts = _wait_for_part(job, out)
    t_kill = time.time()
    removed = cluster.command("remove_worker")["removed"]           # without grace, mid-run
    committed = len(_rows(out))
    assert committed < len(expected), \
        f"the worker was removed too late to test anything ({committed} rows committed)\n{job.tail()}"
    job.gate.touch()                                                 # the held batches may go on now
    cluster.command("add_worker")                                    # a replacement with a logical GPU
    rc = job.wait()
    print(f"worker {removed[:8]} removed {t_kill - job.t0:.1f} s after the job started, with {parts} part(s) "
          f"/ {committed} rows committed; the job ended {time.time() - t_kill:.1f} s later")
    assert rc == 0, f"exit status {rc}\n{job.tail()}\n--- cluster ---\n{cluster.log_tail()}"
    _check_exactly_once(out, expected, job.tail())


def test_head_lost_mid_run_then_resume_on_a_new_cluster_exactly_once(clusters, jobs, tiny_orthrus_dir, tmp_path):
    cfg, expected = _job_config(tmp_path, tiny_orthrus_dir)
    out = tmp_path / "out"
    cluster = clusters()
    # A driver whose GCS is gone retries it for gcs_rpc_server_reconnect_timeout_s (60 s by default),
    # then Ray ends the process (status 1, "Failed to connect to GCS within N seconds"): shortened here.
    job = jobs(cfg, cluster.gcs, env={"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_S)})
    _wait_for_part(job, out)
    t_kill = time.time()
    cluster.command("kill_head")                                     # the driver's node, without grace
    try:
        rc = job.proc.wait(timeout=HEAD_LOSS_GRACE)
        ended = f"ended by itself with status {rc} {time.time() - t_kill:.1f} s after the head was killed"
    except subprocess.TimeoutExpired:
        rc = None
        job.kill()
        ended = f"did not end by itself within {HEAD_LOSS_GRACE} s; SIGKILLed"
    cluster.shutdown()
    job.gate.touch()                                                 # the resumed run is not held
    before = {p.name: p.read_bytes() for p in _parts(out)}
    done = [(r["id"], r["sample_index"]) for r in _rows(out)]
    print(f"driver {ended}; {len(before)} parts / {len(done)} rows committed; "
          f"lease file left behind: {(out / '_lease.json').exists()}")
    assert rc != 0, f"the driver reported success after losing its head\n{job.tail()}"
    assert len(done) == len(set(done)) and 0 < len(done) < len(expected), f"{len(done)} rows\n{job.tail()}"

    cluster = clusters()                                             # a new cluster, the same command
    resumed = jobs(cfg, cluster.gcs, "--resume", name="resume")
    rc = resumed.wait()
    assert rc == 0, f"exit status {rc}\n{resumed.tail()}\n--- first run ---\n{job.tail(2000)}"
    _check_exactly_once(out, expected, resumed.tail())
    assert all((out / "data" / name).read_bytes() == data for name, data in before.items()), \
        "a part committed before the head was lost changed on resume"
