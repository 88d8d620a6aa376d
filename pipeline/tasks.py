"""One function over many argument tuples: as Ray tasks when Ray is running, inline otherwise.

Shared by the output repairs (``output/repair.py``) and the input staging (``inputs/staging.py``):
both run one independent, retry-safe task per file or part and bring back only small results, so
the driver's work is bounded by the number of calls, and tests without Ray run the same code inline.
"""
from __future__ import annotations

from typing import Any, Callable

from pipeline.exceptions import ray_cause


def map_tasks(fn: Callable[..., Any], calls: list[tuple]) -> list:
    """``fn(*args)`` for each call, results in call order. Retried on a lost worker (each task
    writes atomically, so running one twice is harmless)."""
    import ray

    if not calls:
        return []
    if not ray.is_initialized():
        return [fn(*args) for args in calls]
    task = ray.remote(fn).options(num_cpus=1, max_retries=3)
    try:
        return ray.get([task.remote(*args) for args in calls])
    except ray.exceptions.RayTaskError as e:
        # The task's own exception (a refusal such as ConfigError reads as one line), not Ray's
        # wrapper of it, whose message is the remote traceback; that stays on the chain for logs.
        cause = ray_cause(e)
        if isinstance(cause, Exception):
            raise cause from e
        raise
