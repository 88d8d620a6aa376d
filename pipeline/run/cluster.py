"""Connect the driver to Ray: the cluster of ``ray job submit`` / ``--address``, or an embedded one."""
from __future__ import annotations

import os
import sys


def connect(address: str | None = None) -> str:
    """Initialise Ray once; returns 'cluster' or 'local' (embedded, on this machine's CPUs).

    ``ray job submit`` sets ``RAY_ADDRESS`` for the driver, so the same command runs on a cluster
    and, without that variable, on an embedded local Ray.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    # Ray colours the "(MapWorker pid=...)" prefix of the actors' lines it prints here; in a file or a
    # pipe the codes are noise (Ray reads the variable as it prints; a user's own setting wins).
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        return "cluster" if address else "local"
    if address:
        ray.init(address=address, log_to_driver=True)
        return "cluster"
    # address="local": always a new embedded Ray, even when a head runs in the default temp dir
    # (ray.init would find it and refuse num_cpus: "When connecting to an existing cluster, ...").
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)
    return "local"
