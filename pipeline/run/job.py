"""One generation job: preflight (no Ray, no model), then run on a connected Ray and summarise."""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import ConfigError, JobConfig
from pipeline.run.dataset import build_dataset
from pipeline.run.fingerprint import check_unchanged, fingerprint
from pipeline.rows.inputs import InputPlan, inspect_inputs
from pipeline.storage.model_files import check_weight_headers, load_tokenizer, resolve_model_dir
from pipeline.storage.lease import Lease
from pipeline.storage.model_cache import check_remote_weight_headers
from pipeline.storage.object_lease import ObjectLease
from pipeline.output.object_directory import ObjectOutputDir
from pipeline.output.directory import OutputDir, OutputWriteError
from pipeline.report.progress import Progress
from pipeline.rows.prompts import uses_chat_template
from pipeline.output.repair import RETRIED_DIR, dedupe, retry_errors
from pipeline.run.resources import check_engine_placement, resolve_placement
from pipeline.rows.schema import output_schema, to_output_table
from pipeline.storage.uris import is_remote, local_path, locate
from pipeline.actor.stage import GenerationStage
from pipeline.report.summary import render_table, summarize
from pipeline.report.throughput import ThroughputTracker


@dataclass(frozen=True)
class Prepared:
    """A config whose inputs, model files and output directory passed preflight."""

    config: JobConfig
    inputs: InputPlan
    out: OutputDir | ObjectOutputDir


def open_output(config: JobConfig) -> OutputDir | ObjectOutputDir:
    """The output directory: local (rename commits) or on an object store (one PUT per part)."""
    if is_remote(config.output.path):
        return ObjectOutputDir(locate(config.output.path, config.storage, "output.path"))
    return OutputDir(local_path(config.output.path))


def take_lease(out: OutputDir | ObjectOutputDir) -> Lease:
    """The exclusive writer's lease on ``out`` (``lease.py`` locally, ``object_lease.py`` on a store)."""
    return ObjectLease(out.loc, out.run_id) if isinstance(out, ObjectOutputDir) else Lease(out.root, out.run_id)


def _check_model(config: JobConfig, inputs: InputPlan) -> None:
    model_dir = resolve_model_dir(config.model, config.storage, weights=False)
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json (not an HF-layout checkpoint)")
    if is_remote(config.model.path):          # weights are downloaded by the actors: check them where they are
        check_remote_weight_headers(locate(config.model.path, config.storage, "model.path"))
    elif os.path.isdir(local_path(config.model.path)):   # a hub checkpoint's weights: fetched by the actors
        check_weight_headers(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if config.prompt.chat_template == "on" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"prompt.chat_template is 'on' but the tokenizer in {model_dir} has no chat template")
    if not uses_chat_template(config.prompt, tokenizer) and inputs.prompt_column is None:
        raise ConfigError(f"prompt.chat_template is off, so rows need the prompt column "
                          f"{config.input.prompt_column!r} (input.prompt_column), which no input file has")


def preflight(config: JobConfig) -> Prepared:
    """Check inputs, model files and output dir; raise :class:`ConfigError` naming the problem.

    Reads Parquet footers, the id column and the tokenizer only: no Ray, no model weights.
    """
    out = open_output(config)                 # a bad output URI fails first, before inputs are read
    inputs = inspect_inputs(config.input, config.storage)
    _check_model(config, inputs)
    out.check(config.behaviour, inputs.roots, inputs.files, config.model.path, inputs.scheme)
    if config.behaviour.resume and out.marker_exists:
        recorded = out.recorded()
        check_unchanged(recorded.get("fingerprint"), recorded.get("model"), fingerprint(config),
                        config.behaviour.allow_config_change, out.root)
    return Prepared(config, inputs, out)


def _commit_blocks(dataset, out: OutputDir, schema, tracker: ThroughputTracker, progress: Progress,
                   deadline: float | None) -> bool:
    """Commit every block of ``dataset`` as one part file, as it arrives → whether the deadline
    (``time.time()``) stopped it first."""
    batches = iter(dataset.iter_batches(batch_size=None, batch_format="pyarrow"))
    if deadline is not None:
        return _commit_until(batches, deadline, lambda b: _commit(b, out, schema, tracker, progress))
    try:
        for batch in batches:
            _commit(batch, out, schema, tracker, progress)
    finally:
        # On an early exit (a failed commit) stop the streaming executor now, while Ray is still up:
        # left to garbage collection, its threads outlive a later ray.shutdown() and can take the
        # driver process down with them (seen with several batches in flight per actor).
        batches.close()
    return False


def _commit(batch, out: OutputDir, schema, tracker: ThroughputTracker, progress: Progress) -> None:
    if batch.num_rows:
        tracker.add(batch)
        out.commit(to_output_table(batch, schema))
        progress.update(batch.num_rows, tracker.steady_tokens_per_second())


def _commit_until(batches, deadline: float, commit: Callable) -> bool:
    """Like the loop above, but the blocks are pulled in a daemon thread, so that the deadline is
    kept while no block arrives. At the deadline nothing more is committed (a commit in progress
    completes first); the blocks still in flight are generated again by ``--resume``."""
    blocks: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def pump() -> None:
        try:
            for batch in batches:
                if not _put(blocks, ("block", batch), stop):
                    return
            _put(blocks, ("end", None), stop)
        except BaseException as e:  # noqa: BLE001 - handed to the committing thread
            _put(blocks, ("error", e), stop)
        finally:
            batches.close()

    threading.Thread(target=pump, name="orthrus-blocks", daemon=True).start()
    try:
        while (remaining := deadline - time.time()) > 0:
            try:
                kind, item = blocks.get(timeout=remaining)
            except queue.Empty:
                break
            if kind == "end":
                return False
            if kind == "error":
                raise item
            commit(item)
        return True
    finally:
        stop.set()


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless ``stop`` is set first → whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def _throughput(tracker: ThroughputTracker, start: float, wall: float, placement) -> dict:
    """The run's rows, tokens, rates, occupancy, placement, actors and cost (``summary.json["run"]``)."""
    occupancy = tracker.slot_occupancy()
    return {
        "rows_generated": tracker.total_rows, "completion_tokens": tracker.total_tokens,
        "tokens_per_second": tracker.total_tokens / wall if wall else None,
        "startup_seconds": tracker.startup_seconds(start),
        "steady_tokens_per_second": tracker.steady_tokens_per_second(),
        "slot_occupancy": occupancy["until_input_ran_out"], "slot_occupancy_whole_run": occupancy["whole_run"],
        "placement": {"replicas": placement.replicas, "gpus_per_replica": placement.gpus_per_replica,
                      "cpus_per_replica": placement.cpus_per_replica},
        "actors": tracker.report(),
        "cost": _cost(placement, wall, tracker),
    }


def _cost(placement, wall: float, tracker: ThroughputTracker) -> dict:
    """Device-seconds this run held (replicas x devices each x wall time) and kept busy (engine time)."""
    device = "gpu" if placement.use_gpu else "cpu"
    per_replica = placement.gpus_per_replica if placement.use_gpu else placement.cpus_per_replica
    reserved = wall * placement.replicas * per_replica
    busy = sum(a["busy_seconds"] for a in tracker.report()) * per_replica
    return {"device": device, "device_seconds_reserved": round(reserved, 3), "device_seconds_busy": round(busy, 3),
            "tokens_per_device_hour": round(tracker.total_tokens / reserved * 3600, 1) if reserved else None}


def run(prepared: Prepared, mode: str, stage_cls: type = GenerationStage,
        echo: Callable[[str], None] = print) -> dict:
    """Run the dataset (Ray must be initialised), commit every block, write and return the summary."""
    import ray

    start = time.time()
    config, inputs, out = prepared.config, prepared.inputs, prepared.out
    placement = resolve_placement(config.resources, ray.cluster_resources())
    check_engine_placement(config.engine, placement)
    out.prepare(config.behaviour, {"model": config.model.path, "fingerprint": fingerprint(config),
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    if config.behaviour.dedupe:
        echo(f"[orthrus] --dedupe: removed {dedupe(out)} duplicate row(s), keeping the first committed copy of each")
    if config.behaviour.retry_errors:
        echo(f"[orthrus] --retry-errors: {retry_errors(out)} error row(s) moved to {out.root}/{RETRIED_DIR}; "
             "generating them again")
    finished = out.finished_keys()
    echo(f"[orthrus] {inputs.num_rows} input rows x {config.sampling.n} samples in {len(inputs.files)} file(s); "
         f"{len(finished)} already done; {placement.replicas} replica(s), {placement.gpus_per_replica:g} GPU and "
         f"{placement.cpus_per_replica:g} CPU each; output {out.root}")
    schema = output_schema(inputs.passthrough_fields)
    tracker = ThroughputTracker()
    dataset = build_dataset(config, inputs, finished, placement, stage_cls)
    expected = inputs.num_rows * config.sampling.n
    limit = config.behaviour.max_wall_seconds
    progress = Progress(expected, len(finished), echo)
    try:
        stopped = _commit_blocks(dataset, out, schema, tracker, progress, None if limit is None else start + limit)
    finally:
        progress.close()
    wall = time.time() - start
    if stopped:
        echo(f"[orthrus] behaviour.max_wall_seconds={limit:g} reached: stopped after {wall:.0f} s with "
             f"{len(finished) + tracker.total_rows}/{expected} rows committed. The committed parts are complete; "
             "rerun with --resume to continue")
    run_info = {"run_id": out.run_id, "mode": mode, "wall_seconds": round(wall, 3), "rows_expected": expected,
                "stopped_by": "max_wall_seconds" if stopped else None, "rows_skipped_as_finished": len(finished),
                **_throughput(tracker, start, wall, placement)}
    summary = summarize(out, run_info, config.model_dump(mode="json"))
    echo(render_table(summary, str(out.root)))
    if summary["rows"]["duplicate_keys"]:  # impossible with the lease; loud if it was bypassed
        raise OutputWriteError(f"{out.root}: {summary['rows']['duplicate_keys']} duplicate (id, sample_index) rows; "
                               "was another job writing to the same output dir? Repair with --dedupe")
    return summary
