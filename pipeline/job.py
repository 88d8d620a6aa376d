"""One generation job: preflight (no Ray, no model), then run on a connected Ray and summarise."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import ConfigError, JobConfig
from pipeline.dataset import build_dataset
from pipeline.inputs import InputPlan, inspect_inputs
from pipeline.model_files import load_tokenizer, resolve_model_dir
from pipeline.output import OutputDir
from pipeline.prompts import uses_chat_template
from pipeline.resources import check_engine_placement, resolve_placement
from pipeline.schema import output_schema, to_output_table
from pipeline.stage import GenerationStage
from pipeline.summary import render_table, summarize
from pipeline.throughput import ThroughputTracker


@dataclass(frozen=True)
class Prepared:
    """A config whose inputs, model files and output directory passed preflight."""

    config: JobConfig
    inputs: InputPlan
    out: OutputDir


def _check_model(config: JobConfig, inputs: InputPlan) -> None:
    model_dir = resolve_model_dir(config.model, weights=False)
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json (not an HF-layout checkpoint)")
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
    inputs = inspect_inputs(config.input)
    _check_model(config, inputs)
    out = OutputDir(config.output.path)
    out.check(config.behaviour, inputs.roots, inputs.files, config.model.path)
    return Prepared(config, inputs, out)


def _commit_blocks(dataset, out: OutputDir, schema, tracker: ThroughputTracker, progress: Callable[[], str],
                   echo: Callable[[str], None]) -> None:
    """Commit every block of ``dataset`` as one part file, as it arrives."""
    batches = iter(dataset.iter_batches(batch_size=None, batch_format="pyarrow"))
    try:
        for batch in batches:
            if batch.num_rows:
                tracker.add(batch)
                part = out.commit(to_output_table(batch, schema))
                echo(f"[orthrus] committed {part.name}: {batch.num_rows} rows ({progress()} done)")
    finally:
        # On an early exit (a failed commit) stop the streaming executor now, while Ray is still up:
        # left to garbage collection, its threads outlive a later ray.shutdown() and can take the
        # driver process down with them (seen with several batches in flight per actor).
        batches.close()


def run(prepared: Prepared, mode: str, stage_cls: type = GenerationStage,
        echo: Callable[[str], None] = print) -> dict:
    """Run the dataset (Ray must be initialised), commit every block, write and return the summary."""
    import ray

    start = time.time()
    config, inputs, out = prepared.config, prepared.inputs, prepared.out
    placement = resolve_placement(config.resources, ray.cluster_resources())
    check_engine_placement(config.engine, placement)
    out.prepare(config.behaviour, {"model": config.model.path,
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    finished = out.finished_keys()
    echo(f"[orthrus] {inputs.num_rows} input rows x {config.sampling.n} samples in {len(inputs.files)} file(s); "
         f"{len(finished)} already done; {placement.replicas} replica(s), {placement.gpus_per_replica:g} GPU and "
         f"{placement.cpus_per_replica:g} CPU each; output {out.root}")
    schema = output_schema(inputs.passthrough_fields)
    tracker = ThroughputTracker()
    dataset = build_dataset(config, inputs, finished, placement, stage_cls)
    expected = inputs.num_rows * config.sampling.n
    _commit_blocks(dataset, out, schema, tracker, lambda: f"{len(finished) + tracker.total_rows}/{expected}", echo)
    wall = time.time() - start
    run_info = {
        "run_id": out.run_id, "mode": mode, "wall_seconds": round(wall, 3), "rows_expected": expected,
        "rows_skipped_as_finished": len(finished), "rows_generated": tracker.total_rows,
        "completion_tokens": tracker.total_tokens,
        "tokens_per_second": tracker.total_tokens / wall if wall else None,
        "startup_seconds": tracker.startup_seconds(start),
        "steady_tokens_per_second": tracker.steady_tokens_per_second(),
        "slot_occupancy": tracker.slot_occupancy()["until_input_ran_out"],
        "slot_occupancy_whole_run": tracker.slot_occupancy()["whole_run"],
        "placement": {"replicas": placement.replicas, "gpus_per_replica": placement.gpus_per_replica,
                      "cpus_per_replica": placement.cpus_per_replica},
        "actors": tracker.report(),
    }
    summary = summarize(out, run_info, config.model_dump(mode="json"))
    echo(render_table(summary, str(out.root)))
    if summary["rows"]["duplicate_keys"]:  # impossible with one writer; loud if two jobs shared the dir
        raise RuntimeError(f"{out.root}: {summary['rows']['duplicate_keys']} duplicate (id, sample_index) rows; "
                           "was another job writing to the same output dir?")
    return summary
