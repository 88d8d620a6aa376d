"""One generation job: preflight (no Ray, no model), then run on a connected Ray and summarise."""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import ConfigError, JobConfig
from pipeline.run.dataset import build_dataset
from pipeline.run.fingerprint import check_unchanged, fingerprint
from pipeline.inputs.plan import InputPlan, inspect_inputs
from pipeline.inputs.staging import JsonSources, input_format, sniff_sources, stage
from pipeline.output.export import check_openai_batch_n, export
from pipeline.storage.model_files import check_weight_headers, load_tokenizer, resolve_model_dir
from pipeline.storage.lease import Lease, take_lease as _take_lease
from pipeline.storage.model_cache import check_remote_weight_headers
from pipeline.output.directory import OutputDir, OutputWriteError
from pipeline.output.parts import PartWriter
from pipeline.run.commit import CommitLoop, run_loop
from pipeline.inputs.checks import check_ids, verify_inputs
from pipeline.inputs.source import row_group_tasks
from pipeline.report.progress import Progress
from pipeline.requests.prompts import ChatTemplate, uses_chat_template
from pipeline.output.directory import RETRIED_DIR, SUCCESS, SUMMARY_JSON
from pipeline.output.success import mark_complete
from pipeline.run.resources import check_engine_placement, resolve_placement
from pipeline.schema import output_schema
from pipeline.storage.uris import is_remote, local_path, locate
from pipeline.actor.stage import GenerationStage
from pipeline.report.startup import DriverClock
from pipeline.report.summary import render_table, summarize
from pipeline.report.throughput import ThroughputTracker


@dataclass(frozen=True)
class Prepared:
    """A config whose inputs, model files and output directory passed preflight."""

    config: JobConfig
    inputs: InputPlan | None          # None for JSONL inputs until ``run`` stages them
    out: OutputDir
    sources: JsonSources | None = None    # JSONL / OpenAI-batch inputs (sniffed, not yet staged)
    output_format: str = "parquet"    # what ``data/`` is also rendered as when the run completes


def open_output(config: JobConfig) -> OutputDir:
    """The output directory: local (rename commits) or on an object store (one PUT per part)."""
    return OutputDir(config.output.path, config.storage)


def take_lease(out: OutputDir) -> Lease:
    """The exclusive writer's lease on ``out`` (``storage/lease.py``)."""
    return _take_lease(out.where, out.run_id)


def _check_structured(config: JobConfig, tokenizer) -> None:
    """Compile ``sampling.structured`` for the model's tokenizer: a schema, pattern or grammar that
    does not compile fails the job now (exit 2), not as every row's error after the model loads."""
    if config.sampling.structured is None:   # nothing to compile: the compiler's imports are not needed
        return
    from orthrus import check_structured

    try:
        check_structured(tokenizer, config.sampling.structured)
    except ValueError as e:
        raise ConfigError(f"sampling.structured: {str(e).replace('SamplingParams.structured', 'structured')}"
                          [:2000]) from None


def _check_model(config: JobConfig, inputs: InputPlan | None) -> None:
    model_dir = resolve_model_dir(config.model, config.storage, weights=False)
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json (not an HF-layout checkpoint)")
    if is_remote(config.model.path):          # weights are downloaded by the actors: check them where they are
        check_remote_weight_headers(locate(config.model.path, config.storage, "model.path"))
    elif os.path.isdir(local_path(config.model.path)):   # a hub checkpoint's weights: fetched by the actors
        check_weight_headers(model_dir)
    tokenizer = load_tokenizer(model_dir)
    _check_structured(config, tokenizer)
    if config.prompt.chat_template == "on" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"prompt.chat_template is 'on' but the tokenizer in {model_dir} has no chat template")
    if inputs is not None and not uses_chat_template(ChatTemplate.of(config.prompt), tokenizer) \
            and inputs.prompt_column is None:
        raise ConfigError(f"prompt.chat_template is off, so rows need the prompt column "
                          f"{config.input.prompt_column!r} (input.prompt_column), which no input file has")


def preflight(config: JobConfig) -> Prepared:
    """Check inputs, model files and output dir; raise :class:`ConfigError` naming the problem.

    Reads Parquet footers (or the first line of each JSONL file) and the tokenizer only (time and
    memory bounded by files): no Ray, no rows, no model weights.
    """
    out = open_output(config)                 # a bad output URI fails first, before inputs are read
    fmt = input_format(config.input, config.storage)
    inputs = inspect_inputs(config.input, config.storage) if fmt == "parquet" else None
    sources = sniff_sources(config.input, config.storage, fmt) if inputs is None else None
    output_format = config.output.format or fmt
    if output_format == "openai_batch":
        check_openai_batch_n(config.sampling.n)
    _check_model(config, inputs)
    found = inputs or sources
    out.check(config.behaviour, found.roots, found.files, config.model.path, found.scheme)
    if config.behaviour.resume and out.marker_exists:
        recorded = out.recorded()
        check_unchanged(recorded.get("fingerprint"), recorded.get("model"), fingerprint(config),
                        config.behaviour.allow_config_change, out.root)
    return Prepared(config, inputs, out, sources, output_format)


def _throughput(tracker: ThroughputTracker, start: float, wall: float, placement,
                clock: DriverClock | None = None) -> dict:
    """The run's rows, tokens, rates, occupancy, placement, actors and cost (``summary.json["run"]``)."""
    occupancy = tracker.slot_occupancy()
    return {
        "rows_generated": tracker.total_rows, "completion_tokens": tracker.total_tokens,
        "tokens_per_second": tracker.total_tokens / wall if wall else None,
        "startup_seconds": tracker.startup_seconds(start),
        "startup": tracker.startup(clock),
        "steady_tokens_per_second": tracker.steady_tokens_per_second(),
        "steady_rows_per_second": tracker.steady_rows_per_second(),
        "slot_occupancy": occupancy["until_input_ran_out"], "slot_occupancy_whole_run": occupancy["whole_run"],
        "placement": {"replicas": placement.replicas, "gpus_per_replica": placement.gpus_per_replica,
                      "cpus_per_replica": placement.cpus_per_replica},
        "actors": tracker.report(),
        "cost": _cost(placement, wall, tracker),
    }


def _cost(placement, wall: float, tracker: ThroughputTracker) -> dict:
    """Device-seconds this run held (replicas x devices each x wall time) and kept busy (engine time),
    and what they cost per unit of work. A device is a GPU on GPU replicas, a CPU core on CPU ones."""
    device = "gpu" if placement.use_gpu else "cpu"
    per_replica = placement.gpus_per_replica if placement.use_gpu else placement.cpus_per_replica
    reserved = wall * placement.replicas * per_replica
    busy = sum(a["busy_seconds"] for a in tracker.report()) * per_replica
    tokens = tracker.total_tokens
    return {"device": device, "device_seconds_reserved": round(reserved, 3), "device_seconds_busy": round(busy, 3),
            "tokens_per_device_hour": round(tokens / reserved * 3600, 1) if reserved else None,
            # the budget unit of generation plans (datatrove's gpu_days_to_process_1b_tokens): held
            # device time, not busy time, since a held device is paid for either way
            "device_days_per_billion_output_tokens": reserved / 86400 / (tokens / 1e9) if tokens else None}


def _repairs(config: JobConfig, out: OutputDir, echo: Callable[[str], None]) -> None:
    from pipeline.output.repair import dedupe, retry_errors

    if config.behaviour.dedupe:
        echo(f"[orthrus] --dedupe: removed {dedupe(out)} duplicate row(s), keeping the first committed copy of each")
    if config.behaviour.retry_errors:
        echo(f"[orthrus] --retry-errors: {retry_errors(out)} error row(s) moved to {out.root}/{RETRIED_DIR}; "
             "generating them again")


def _loop(config: JobConfig, inputs: InputPlan, out: OutputDir, tracker: ThroughputTracker,
          progress: Progress, ids_checked) -> CommitLoop:
    writer = PartWriter(out, output_schema(inputs.passthrough_fields), inputs.files, config.sampling.n,
                        config.output.part_bytes, config.output.part_seconds)
    return CommitLoop(writer, writer.schema, tracker, progress, ids_checked)


def _halt(dataset) -> None:
    """Stop a running dataset's streaming executor now (its tasks and actors are cancelled).

    Ray Data keeps the executor of an ``iter_batches`` on the dataset and shuts it down itself only
    when the dataset is garbage-collected; by then Ray may be shutting down, and its threads then
    print a traceback after the summary (or take the process down). This calls the same shutdown
    (``Dataset._synchronize_progress_bar``, Ray's own helper for exactly this) at a known moment.
    """
    if dataset is None:
        return
    try:
        dataset._synchronize_progress_bar()
    except Exception as e:  # noqa: BLE001 - best effort: the pump's join still bounds the wait
        print(f"[orthrus] could not stop the dataset's executor: {type(e).__name__}: {e}", flush=True)


def _staged(config: JobConfig, sources: JsonSources, out: OutputDir, echo: Callable[[str], None]) -> InputPlan:
    """JSONL inputs converted to Parquet under ``<output>/_staged/`` by Ray tasks (one per file;
    reused when unchanged), then checked like Parquet inputs."""
    t0 = time.time()
    inputs = inspect_inputs(stage(sources, config.input, out), config.storage)
    _check_model(config, inputs)
    echo(f"[orthrus] {len(sources.files)} {sources.format} file(s) staged as Parquet in {time.time() - t0:.1f} s")
    return inputs


def _export(prepared: Prepared, summary: dict, echo: Callable[[str], None]) -> None:
    """Render a complete ``data/`` as JSONL / OpenAI-batch files (one Ray task), noted in summary.json."""
    if prepared.output_format == "parquet" or not summary["run"]["complete"]:
        return
    config, out = prepared.config, prepared.out
    summary["exports"] = export(out, prepared.output_format, config.model, config.storage)
    out.write_atomic(SUMMARY_JSON, json.dumps(summary, indent=2).encode())
    made = summary["exports"]
    echo(f"[orthrus] {prepared.output_format}: {made['results_lines']} line(s) in {made['results']}"
         + (f", {made['error_lines']} in {made['errors']}" if made["errors"] else ""))


def _pending(config: JobConfig, inputs: InputPlan, out: OutputDir) -> tuple[dict, int]:
    """What is left, from the part footers → (files with samples left, each with its finished
    ranges; rows already committed)."""
    done, _, _ = out.done()
    pending = done.pending(inputs.files, inputs.file_rows, config.sampling.n)
    if not row_group_tasks(inputs, pending):    # every row group finished: nothing to read
        pending = {}
    return pending, done.rows


def run(prepared: Prepared, mode: str, stage_cls: type = GenerationStage,
        echo: Callable[[str], None] = print, clock: DriverClock | None = None) -> dict:
    """Run the dataset (Ray must be initialised), commit every block, write and return the summary.

    ``clock``: when the process and ``ray.init`` started (the summary's start-up split)."""
    import ray

    start = time.time()
    config, out = prepared.config, prepared.out
    placement = resolve_placement(config.resources, ray.cluster_resources())
    check_engine_placement(config.engine, placement)
    out.prepare(config.behaviour, {"model": config.model.path, "fingerprint": fingerprint(config),
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    _repairs(config, out, echo)
    inputs = prepared.inputs or _staged(config, prepared.sources, out, echo)
    pending, finished = _pending(config, inputs, out)
    echo(f"[orthrus] {inputs.num_rows} input rows x {config.sampling.n} samples in {len(inputs.files)} file(s); "
         f"{finished} already done ({len(inputs.files) - len(pending)} file(s) finished); {placement.replicas} "
         f"replica(s), {placement.gpus_per_replica:g} GPU and {placement.cpus_per_replica:g} CPU each; "
         f"output {out.root}")
    if config.input.verify == "full":
        verify_inputs(inputs)
    tracker = ThroughputTracker()
    expected = inputs.num_rows * config.sampling.n
    limit = config.behaviour.max_wall_seconds
    progress = Progress(expected, finished, echo)
    checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orthrus-ids")
    try:
        ids_checked = checker.submit(check_ids, inputs)
        # No more work for it: its thread ends with the check. An idle pool thread lives until shutdown,
        # and the commit loop waits (10 s, bounded) for every "orthrus-ids" thread before Ray may stop.
        checker.shutdown(wait=False)
        loop = _loop(config, inputs, out, tracker, progress, ids_checked)
        dataset = build_dataset(config, inputs, pending, placement, stage_cls) if pending else None
        blocks = dataset.iter_batches(batch_size=None, batch_format="pyarrow") if dataset is not None else ()
        stopped = run_loop(iter(blocks), loop, None if limit is None else start + limit,
                           halt=lambda: _halt(dataset))
        if not stopped:
            ids_checked.result()       # even a resume with nothing left proves the ids unique
    finally:
        progress.close()
        checker.shutdown(wait=False, cancel_futures=True)
    wall = time.time() - start
    if stopped:
        echo(f"[orthrus] behaviour.max_wall_seconds={limit:g} reached: stopped after {wall:.0f} s with "
             f"{finished + tracker.total_rows}/{expected} rows committed. The committed parts are complete; "
             "rerun with --resume to continue")
    run_info = {"run_id": out.run_id, "mode": mode, "wall_seconds": round(wall, 3), "input_rows": inputs.num_rows,
                "samples_per_row": config.sampling.n, "rows_expected": expected,
                "stopped_by": "max_wall_seconds" if stopped else None, "rows_skipped_as_finished": finished,
                "parts_committed": out.committed, **_throughput(tracker, start, wall, placement, clock)}
    summary = summarize(out, run_info, config.model_dump(mode="json"))
    echo(render_table(summary, str(out.root)))
    _export(prepared, summary, echo)
    if summary["rows"]["duplicate_keys"]:  # impossible with the lease; loud if it was bypassed
        raise OutputWriteError(f"{out.root}: {summary['rows']['duplicate_keys']} duplicate (id, sample_index) rows; "
                               "was another job writing to the same output dir? Repair with --dedupe")
    if mark_complete(out, summary):      # the last write of the run: a sensor may read the output now
        echo(f"[orthrus] complete: {out.root}/{SUCCESS} written")
    return summary
