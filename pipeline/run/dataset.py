"""The Ray Data graph: input row groups (``rows/source.py`` read tasks) -> preprocess (CPU tasks)
-> generate + detokenize (actors).

The driver consumes the result and streams it into parts (``run/commit.py``); nothing here writes.
"""
from __future__ import annotations

from pipeline.config import JobConfig
from pipeline.actor.faults import FaultInjector, from_environment
from pipeline.rows.inputs import InputPlan
from pipeline.rows.source import Pending, make_datasource
from pipeline.rows.preprocess import PreprocessPlan, preprocess_batch
from pipeline.run.resources import Placement
from pipeline.actor.stage import GenerationStage, StagePlan


# Preprocessing (tokenization) works on batches of this many rows: large enough that a task's
# overhead is small next to its work, small enough that the first batches reach the actors while
# the rest of a big row group is still being tokenized.
PREPROCESS_ROWS = 1024
# Ray Data holds a task's output until it reaches this size before passing it on (128 MiB by
# default): a read task over a 100k-row group, or a preprocess task over it, would then emit
# nothing until all of it is done, and start-up would grow with row-group size (measured in
# jobs/bench_scale.py). Small blocks let the first batches through at once.
BLOCK_BYTES = 1 << 20


def build_dataset(config: JobConfig, inputs: InputPlan, pending: dict[str, Pending | None], placement: Placement,
                  stage_cls: type = GenerationStage):
    """The lazy dataset whose blocks are finished output rows (plus internal columns).

    ``pending`` (``output/sources.py``): the files with samples left to generate, each with its own
    finished ranges; the other files are not read.
    """
    import ray.data

    # The driver shows one progress bar of its own (rows committed of expected, tokens/s, ETA);
    # Ray Data's per-operator bars would interleave with it.
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.target_max_block_size = BLOCK_BYTES
    faults = from_environment()
    FaultInjector.parse(faults)  # a malformed test spec fails here, not in every actor's constructor
    ds = ray.data.read_datasource(make_datasource(inputs, pending, config.sampling.n))
    pre = PreprocessPlan(inputs=inputs, model=config.model, prompt=config.prompt, sampling=config.sampling,
                         storage=config.storage)
    # Straight after the read (no repartition between): reads and tokenization interleave instead
    # of every read finishing before the first row is tokenized.
    ds = ds.map_batches(preprocess_batch, fn_kwargs={"plan": pre}, batch_format="pyarrow",
                        batch_size=max(PREPROCESS_ROWS, config.engine.batch_size))
    # Re-cut into batch-sized blocks so work spreads over the actors and each finished batch
    # reaches the driver while the job runs.
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
