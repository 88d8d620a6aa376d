"""cluster.yaml: valid for Ray's own cluster launcher, and consistent with the project's pins and layout."""
from __future__ import annotations

import copy
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.config_file import load_config
from support.paths import REPO



@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_ray_launcher_accepts_it(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))  # Ray's schema + node-type checks


def test_node_types_cpu_head_and_autoscaling_gpu_workers(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] >= 2
    workers = {name: t for name, t in types.items() if name != cluster["head_node_type"]}
    gpu = [t for t in workers.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu, "no GPU worker type"
    for t in gpu:
        assert 0 == t["min_workers"] < t["max_workers"] <= cluster["max_workers"]
        # one replica per GPU, plus at least one CPU left for Ray Data's tasks
        assert t["resources"]["CPU"] >= 2
    assert cluster["provider"]["type"] == "aws"


def test_setup_installs_the_project_with_its_pins(cluster):
    pins, commands = _pins(), cluster["setup_commands"]
    joined = "\n".join(commands)
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert "python3.11" in joined and ">=3.11,<3.12" == requires
    for pkg in ("torch", "transformers", "ray"):
        for cmd in commands:  # any explicit install of a pinned package uses the pinned version
            for word in shlex.split(cmd):
                if re.match(rf"^{pkg}(\[.*\])?==", word):
                    assert word.split("==")[1] == pins[pkg], (cmd, pins[pkg])
    install = [c for c in commands if "-c constraints.txt" in c and "pip install" in c]
    assert install and "-e ." in install[0]
    mount = cluster["file_mounts"]
    remote = next(r for r, local in mount.items() if local == ".")
    home = f"/home/{cluster['auth']['ssh_user']}"
    assert f"cd {remote.replace(home, '~')}" in install[0]
    assert ".gitignore" in cluster["rsync_filter"]


def test_start_commands_agree(cluster):
    head = " ".join(cluster["head_start_ray_commands"])
    worker = " ".join(cluster["worker_start_ray_commands"])
    port = re.search(r"--head --port=(\d+)", head).group(1)
    assert f"--address=$RAY_HEAD_IP:{port}" in worker
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head and "--dashboard-host=0.0.0.0" in head
    for cmds in (head, worker):  # the venv's ray and python (what `ray job submit` runs) on every node
        assert "export PATH=$HOME/venv/bin:$PATH" in cmds and "ray stop" in cmds


def test_cluster_job_example_is_valid_and_asks_for_gpus():
    cfg = load_config(REPO / "examples" / "cluster-job.yaml")
    # GPU workers autoscale from zero, so auto-detection would see no GPU: the example is explicit.
    assert cfg.resources.gpus_per_replica == 1 and cfg.resources.replicas
    assert Path(cfg.output.path).is_absolute()


def test_object_storage_job_example_is_valid_and_has_every_path_on_s3():
    from pipeline.storage.uris import scheme_of

    cfg = load_config(REPO / "examples" / "cluster-s3.yaml")
    assert {scheme_of(p) for p in [*cfg.input.paths, cfg.output.path, cfg.model.path]} == {"s3"}
    assert cfg.resources.gpus_per_replica == 1 and cfg.storage.endpoint is None
