"""The benchmarks, one package: ``python -m jobs.bench [workload] [options]`` (``make bench``).

Each workload is a module here with ``add_args(ap)`` (its own arguments; the shared ones are in
``common.py``) and ``main(args)``; results go to ``bench-results/<workload>.json``. Nothing is
imported here: ``jobs/gpu_check.py`` imports ``jobs.bench.speed`` on an image without the job's stack.
"""
from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (the shared arguments and the workload's own) and run that workload."""
    from jobs.bench.common import parse_args, workload_module
    args = parse_args(argv)
    workload_module(args.workload).main(args)
