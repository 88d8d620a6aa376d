"""Batch generation job: Parquet prompts -> Orthrus actors on Ray Data -> Parquet completions.

    python -m jobs.generate --config examples/demo.yaml                  # embedded local Ray
    ray job submit --working-dir . -- python -m jobs.generate --config FILE   # on a cluster

Options: ``--set section.field=value`` (repeatable) overrides the YAML; ``--resume`` continues an
existing output dir; ``--overwrite`` replaces it; ``--dedupe`` repairs a directory that two jobs
once wrote at the same time, ``--retry-errors`` generates the error rows again, and
``--allow-config-change`` accepts a resume with other model, sampling or prompt settings (all three
resume); ``--verbose`` prints Ray's own notices, which otherwise go to a log file named at the start
(``pipeline/run/terminal.py``). The job holds an exclusive lease on its output directory
(``pipeline/storage/lease.py``) from before Ray starts to the end.

Exit status: 0 done (every input row x sample committed; ``<output>/_SUCCESS`` is written last);
1 finished but incomplete (or stopped by ``behaviour.max_wall_seconds``: ``--resume`` continues);
2 refused (config, inputs, output dir, or another job holds the directory; before any model loads,
except a duplicate id, found before the first commit, and an input file that turns out unreadable
mid-run: its message names the file and row group, the parts committed are complete, and
``--resume`` continues once it is fixed); 3 writing the output failed mid-run (disk full,
permissions, a lost lease) -- the parts already committed are complete, so fix the cause and rerun
with ``--resume``; 4 crashed (an unexpected exception): one paragraph on stderr, the traceback in
``<output>/_logs/crash-*.log``. Only a run ending with status 0 writes ``_SUCCESS``, and every run
that starts removes it first (README, "For schedulers").
"""
from __future__ import annotations

import argparse
import os
import sys

from pipeline.run.cluster import connect
from pipeline.config import ConfigError
from pipeline.config_file import load_config
from pipeline.run.job import preflight, run, take_lease
from pipeline.run.crash import crash_message, refusal_message
from pipeline.output.directory import OutputWriteError
from pipeline.run.commit import settle_ray_data_threads
from pipeline.run.terminal import QuietTerminal, ray_log_path
from pipeline.report.startup import DriverClock


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="job config YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set sampling.temperature=0.7")
    p.add_argument("--resume", action="store_true", help="continue into an existing output dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dir")
    p.add_argument("--dedupe", action="store_true", help=(
        "resume, first removing duplicate (id, sample_index) rows (the first committed copy stays)"))
    p.add_argument("--retry-errors", action="store_true", help=(
        "resume, generating the rows committed as errors again (they move to <output>/retried/)"))
    p.add_argument("--allow-config-change", action="store_true", help=(
        "resume even though the model, sampling or prompt settings differ from the recorded ones"))
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else embedded local Ray)")
    p.add_argument("--verbose", action="store_true", help=(
        "print Ray's own notices on the terminal too (by default they go to a log file, named at the start)"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resume and args.overwrite:
        print("error: --resume and --overwrite are mutually exclusive", file=sys.stderr)
        return 2
    # A flag wins over the YAML (e.g. the demo's overwrite: true) for this run; the repairs imply --resume.
    repairs = {"dedupe": args.dedupe, "retry_errors": args.retry_errors, "allow_config_change": args.allow_config_change}
    resume = args.resume or any(repairs.values())
    flags = [f"behaviour.{k}={str(v).lower()}" for k, v in
             {"resume": resume, "overwrite": args.overwrite, **repairs}.items()] if (resume or args.overwrite) else []
    output, terminal, clock = None, None, DriverClock()
    try:
        prepared = preflight(load_config(args.config, [*args.overrides, *flags]))
        output = prepared.out
        with take_lease(output) as lease:   # before Ray starts: one writer per directory
            prepared.out.lease = lease
            terminal = None if args.verbose else QuietTerminal(ray_log_path(output.run_id))
            summary = run(prepared, _connect(args.address, terminal, clock), clock=clock)
    except ConfigError as e:
        _shutdown_ray()
        print(f"error: {refusal_message(e, output)}", file=sys.stderr)
        return 2
    except OutputWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # noqa: BLE001 - anything else is a crash: a paragraph here, the traceback in a file
        message = crash_message(e, output)
        _shutdown_ray()   # its shutdown noise comes before the paragraph, not after it
        print(message, file=sys.stderr)
        return 4
    finally:
        if terminal:
            terminal.close()
    return 0 if summary["run"]["complete"] else 1


def _connect(address: str | None, terminal: QuietTerminal | None, clock: DriverClock) -> str:
    """Start or join Ray (``connect``, timed on ``clock``); with ``terminal``, Ray's own notices go to its log file."""
    if terminal is None:
        return clock.ray(lambda: connect(address))
    terminal.start()
    print(f"[orthrus] Ray's own notices and the actors' lines: {terminal.path} (--verbose prints them here)",
          flush=True)
    mode = clock.ray(lambda: connect(address))
    terminal.divert_native()     # after ray.init: the processes it started keep the real stderr
    terminal.divert_workers()    # after ray.init: it installs the relay of the actors' lines
    return mode


def _shutdown_ray() -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out of a crash
        pass


def _exit(status: int) -> None:
    """Exit with ``status``. If a Ray Data thread is still running, Ray's own shutdown at exit could
    kill the process with status 1 and no message (see ``pipeline/run/commit.py``), so the status is
    made final with ``os._exit`` after flushing; the lease and parts are already settled by then."""
    if not settle_ray_data_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    _exit(main())
