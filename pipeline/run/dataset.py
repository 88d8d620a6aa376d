"""The Ray Data graph: read_parquet -> preprocess (CPU tasks) -> generate + detokenize (actors).

The driver consumes the result and commits each block (see ``output.py``); nothing here writes.
"""
from __future__ import annotations

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.actor.faults import FaultInjector, from_environment
from pipeline.rows.inputs import InputPlan
from pipeline.rows.preprocess import PreprocessPlan, preprocess_batch
from pipeline.run.resources import Placement
from pipeline.actor.stage import GenerationStage, StagePlan


def build_dataset(config: JobConfig, inputs: InputPlan, finished: pa.Array, placement: Placement,
                  stage_cls: type = GenerationStage):
    """The lazy dataset whose blocks are finished output rows (plus internal columns)."""
    import ray.data
    from ray.data.datasource.partitioning import Partitioning

    derive_ids = inputs.id_column is None
    # The driver shows one progress bar of its own (rows committed of expected, tokens/s, ETA);
    # Ray Data's per-operator bars would interleave with it.
    ray.data.DataContext.get_current().enable_progress_bars = False
    faults = from_environment()
    FaultInjector.parse(faults)  # a malformed test spec fails here, not in every actor's constructor
    # Hive partition columns (key=value directories below the inputs' common directory) are read as
    # preflight found them (pipeline/rows/inputs.py); none elsewhere, so a '=' higher up adds nothing.
    partitioning = Partitioning("hive", base_dir=inputs.partition_base) if inputs.partition_columns else None
    ds = ray.data.read_parquet(list(inputs.files), include_paths=derive_ids, include_row_hash=derive_ids,
                               file_extensions=None, partitioning=partitioning,
                               filesystem=inputs.filesystem)
    pre = PreprocessPlan(inputs=inputs, model=config.model, prompt=config.prompt, sampling=config.sampling,
                         storage=config.storage, finished=finished if len(finished) else None)
    ds = ds.map_batches(preprocess_batch, fn_kwargs={"plan": pre}, batch_format="pyarrow")
    # Small shards arrive as one block; re-cut into batch-sized blocks so work spreads over the
    # actors and each finished batch reaches the driver (and disk) while the job runs.
    ds = ds.repartition(target_num_rows_per_block=config.engine.batch_size)
    return ds.map_batches(
        stage_cls,
        fn_constructor_kwargs={"plan": StagePlan(model=config.model, engine=config.engine,
                                                 sampling=config.sampling, use_gpu=placement.use_gpu,
                                                 audit=config.audit,
                                                 row_timeout_s=config.behaviour.row_timeout_s,
                                                 fault_inject=faults, storage=config.storage)},
        batch_size=config.engine.batch_size,
        batch_format="pyarrow",
        # Several batches in flight per actor, all feeding its one engine: its slots stay busy across
        # batch boundaries (each batch still returns, and is committed, on its own).
        compute=ray.data.ActorPoolStrategy(size=placement.replicas,
                                           max_tasks_in_flight_per_actor=config.engine.max_concurrent_batches,
                                           max_concurrent_calls_per_actor=config.engine.max_concurrent_batches),
        num_gpus=placement.gpus_per_replica,
        num_cpus=placement.cpus_per_replica,
    )
