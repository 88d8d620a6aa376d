"""A real local Ray head for end-to-end tests, and the ways the tests drive and inspect a job on it.

The head (``start_head``, the ``head`` fixture of ``tests/conftest.py``) has 4 logical CPUs and 2
logical GPUs (``ray start --num-gpus 2``) on this CPU machine, so two generation actors each get
their own Ray GPU id while running the model on the CPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq

from support.hang import HANG_S
from support.paths import REPO, VENV_BIN


# Start both actors before dispatch, so the work visibly spreads over them.
WAIT_FOR_BOTH_ACTORS = {"RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S": "120"}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def worker_port_range(width: int = 100) -> int:
    """The first of ``width`` free ports for a head's workers, between Ray's default range (10002-19999,
    which embedded clusters use) and the kernel's ephemeral range (from 32768). Blocks are spread by
    pid and kept apart by pytest-xdist worker (gw0, gw1, ... take different blocks), and a block
    with a port in use (another head, another test run) is passed over."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    blocks = (32768 - 20000) // width
    start = (os.getpid() % (blocks // 4)) * 4 + worker % 4
    for i in range(blocks):
        base = 20000 + ((start + 4 * i) % blocks) * width
        if all(_bindable(port) for port in range(base, base + width)):
            return base
    raise RuntimeError("no free block of worker ports in 20000-32767")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def base_env() -> dict[str, str]:
    """This process's environment for a Ray CLI call: no auth, no usage stats, the venv's tools first."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    return env


def killpg(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL, the process group that ``proc`` leads (it was started in its own session)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def start_head() -> Iterator[dict[str, str]]:
    """``ray start --head --block`` in its own session; stopped through its own process group id.
    Yields its addresses: ``gcs``, ``dashboard`` (the job-submission URL) and ``metrics``."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    gcs, dash, agent, agent_grpc, env_agent, metrics, node_mgr, obj_mgr, client = free_ports(9)
    worker_base = worker_port_range()
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--num-cpus=4", "--num-gpus=2", "--object-store-memory=300000000", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
           f"--metrics-export-port={metrics}", f"--node-manager-port={node_mgr}",
           f"--object-manager-port={obj_mgr}", f"--ray-client-server-port={client}",
           f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + 99}", f"--temp-dir={temp}",
           "--disable-usage-stats"]
    log = open(Path(temp) / "head.log", "wb")
    proc = subprocess.Popen(cmd, env=base_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + HANG_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ray head did not start:\n" + (Path(temp) / "head.log").read_text()[-3000:])
                time.sleep(0.5)
        yield {"gcs": f"127.0.0.1:{gcs}", "dashboard": url, "metrics": f"http://127.0.0.1:{metrics}/metrics"}
    finally:
        killpg(proc, grace=3)            # this head's process group only
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def submit(head: dict, config: Path, *args: str, env_vars: dict[str, str] | None = None, wait: bool = True,
           sid: str | None = None, timeout: int = HANG_S) -> subprocess.CompletedProcess:
    """``ray job submit`` of ``python -m jobs.generate --config CONFIG ARGS`` with the repo as working
    dir; ``env_vars`` join the job's runtime environment (the driver's and every worker's)."""
    runtime_env = {"env_vars": {"RAY_AUTH_MODE": "disabled", **(env_vars or {})}}
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", head["dashboard"], "--working-dir", str(REPO),
           "--runtime-env-json", json.dumps(runtime_env),
           *(["--submission-id", sid] if sid else []), *([] if wait else ["--no-wait"]),
           "--", "python", "-m", "jobs.generate", "--config", str(config), *args]
    return subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=timeout)


def part_digests(out: Path) -> dict[str, str]:
    """sha256 of every committed part of a local output directory, by file name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "data").glob("*.parquet"))}


def row_keys(files) -> list[tuple[str, int]]:
    """``(id, sample_index)`` of every row of the given Parquet files."""
    return [(r["id"], r["sample_index"]) for f in files
            for r in pq.read_table(f, columns=["id", "sample_index"]).to_pylist()]


def wait_for(predicate: Callable[[], object], what: str, timeout: float = HANG_S):
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    deadline = time.time() + timeout
    while not (value := predicate()):
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def kill_pid(pid: int) -> None:
    """SIGKILL a Ray worker or job driver of this test, by pid, after checking what it is."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert cmdline.startswith("ray::") or "jobs.generate" in cmdline, cmdline
    os.kill(pid, signal.SIGKILL)


def generation_actor(head: dict, job_id: str) -> int:
    """pid of the job's live generation actor (a Ray Data MapWorker), or 0 while it is starting."""
    from ray.util.state import list_actors

    actors = list_actors(address=head["dashboard"], filters=[("state", "=", "ALIVE")], detail=True)
    pids = [a.pid for a in actors if a.job_id == job_id and "MapWorker" in a.class_name and a.pid]
    return pids[0] if len(pids) == 1 else 0
