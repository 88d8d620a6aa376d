"""How many generation actors to start and what each reserves, from the config and the cluster."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ConfigError, EngineConfig, ResourcesConfig


@dataclass(frozen=True)
class Placement:
    """Resolved actor resources."""

    replicas: int
    gpus_per_replica: float
    cpus_per_replica: float

    @property
    def use_gpu(self) -> bool:
        """Whether the actors hold GPUs (and so load the model on CUDA when it exists)."""
        return self.gpus_per_replica > 0


def resolve_placement(cfg: ResourcesConfig, cluster: dict[str, float]) -> Placement:
    """Fill the automatic fields from ``ray.cluster_resources()`` and check the pool can run.

    On CPU the actors must leave at least one CPU free: Ray Data's read and tokenize tasks need
    one, and an actor pool holding every CPU deadlocks them.
    """
    gpus, cpus = float(cluster.get("GPU", 0)), float(cluster.get("CPU", 0))
    per_gpu = cfg.gpus_per_replica if cfg.gpus_per_replica is not None else (1.0 if gpus > 0 else 0.0)
    if cfg.replicas is not None:
        replicas = cfg.replicas
    elif per_gpu > 0:
        replicas = max(1, int(gpus // per_gpu))
    else:
        replicas = 1
    placement = Placement(replicas, per_gpu, cfg.cpus_per_replica)
    if per_gpu == 0 and cpus and replicas * cfg.cpus_per_replica > cpus - 1:
        raise ConfigError(f"resources: {replicas} replica(s) x {cfg.cpus_per_replica} CPU (resources.replicas x "
                          f"resources.cpus_per_replica) leave no CPU free of the cluster's {cpus:g} for the "
                          "read/tokenize tasks; lower one of them")
    return placement


def check_engine_placement(engine: EngineConfig, placement: Placement) -> None:
    """Engine settings that need GPUs fail here, before any actor loads a model."""
    if engine.attention == "flash" and not placement.use_gpu:
        raise ConfigError("engine.attention='flash' needs GPU replicas (resources.gpus_per_replica > 0 on a "
                          "cluster with GPUs); use 'auto' or 'sdpa' on CPU")
