"""The job's Ray Data graph: input row groups (``inputs/source.py`` read tasks) -> the job's rows
(``inputs/preprocess.py``: samples, ids, seeds, sampling, then the prepare step) -> the processor
(``pipeline/processor``: generate, detokenize).

The driver consumes the result and streams it into parts (``run/commit.py``); nothing here writes.
"""
from __future__ import annotations

from pipeline.config import EngineKwargs, JobConfig
from pipeline.actor.faults import stage_for
from pipeline.actor.stage import GenerationStage
from pipeline.processor.build import StageOptions, generate
from pipeline.processor.config import OrthrusProcessorConfig
from pipeline.inputs.plan import InputPlan
from pipeline.inputs.source import make_datasource
from pipeline.output.sources import Pending
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.run.resources import Placement

# Ray Data holds a task's output until it reaches this size before passing it on (128 MiB by
# default): a read task over a 100k-row group, or a preprocess task over it, would then emit
# nothing until all of it is done, and start-up would grow with row-group size (measured in
# jobs/bench/scale.py). Small blocks let the first batches through at once.
BLOCK_BYTES = 1 << 20


def job_context() -> None:
    """The Ray Data settings of the job's process (the job owns it; the processor alone changes no
    global setting): no Ray progress bars (the driver prints its own line), blocks of at most
    :data:`BLOCK_BYTES`."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.target_max_block_size = BLOCK_BYTES


def read_inputs(inputs: InputPlan, pending: dict[str, Pending | None], n: int):
    """The read operator: one task per pending row group, each emitting its rows as blocks of at
    most :data:`BLOCK_BYTES` (so a big row group still streams).

    The block count is pinned to the task count. Left to itself Ray Data aims at 200 blocks and
    splits each task's output to get there: 10 row groups of 2,000 rows became 200 blocks of 100
    rows, and its executor passed them on about 0.1 s apart (its scheduling round): 18.9 s to read
    20,000 rows whose read tasks took 0.17 s in all, while the actor sat idle a third of the time
    (``jobs.bench short``: job ÷ bare engine 0.62 → 0.92).
    """
    import ray.data

    source = make_datasource(inputs, pending, n)
    return ray.data.read_datasource(source, override_num_blocks=max(1, len(source.tasks)))


def job_processor(config: JobConfig, placement: Placement) -> OrthrusProcessorConfig:
    """The processor settings of a job: the same generation a user's pipeline gets."""
    thinking = config.prompt.enable_thinking
    return OrthrusProcessorConfig(
        model_source=config.model.path, model_revision=config.model.revision, batch_size=config.batch_rows,
        prefix_grouping=config.engine.prefix_grouping, prefix_grouping_rows=config.engine.prefix_grouping_rows,
        concurrency=placement.replicas, max_concurrent_batches=config.engine.max_concurrent_batches,
        resources_per_bundle={"CPU": placement.cpus_per_replica, "GPU": placement.gpus_per_replica},
        apply_chat_template={"on": True, "off": False, "auto": "auto"}[config.prompt.chat_template],
        chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking},
        engine_kwargs=EngineKwargs.model_validate(config.engine.model_dump(include=set(EngineKwargs.model_fields))),
        row_timeout_s=config.behaviour.row_timeout_s, audit=config.audit, storage=config.storage)


def build_dataset(config: JobConfig, inputs: InputPlan, pending: dict[str, Pending | None], placement: Placement,
                  stage_cls: type = GenerationStage):
    """The lazy dataset whose blocks are finished output rows (plus internal columns).

    ``pending`` (``output/sources.py``): the files with samples left to generate, each with its own
    finished ranges; the other files are not read.
    """
    job_context()
    stage_cls, stage_kwargs = stage_for(stage_cls)    # test-only faults; a malformed spec fails here
    ds = read_inputs(inputs, pending, config.sampling.n)
    pre = PreprocessPlan(inputs=inputs, model=config.model, prompt=config.prompt, sampling=config.sampling,
                         storage=config.storage, group=config.engine.prefix_grouping)
    # Straight after the read (no repartition between): reads and tokenization interleave instead
    # of every read finishing before the first row is tokenized. The job's rows and their prepare
    # step are one call, so each row's SamplingParams is built once (the processor skips its own).
    ds = ds.map_batches(preprocess_batch, fn_kwargs={"plan": pre}, batch_format="pyarrow",
                        batch_size=config.engine.prepare_window(config.batch_rows))
    options = StageOptions(batch_records=True, keep_inputs=False, prepared=True, stage_cls=stage_cls,
                           stage_kwargs=tuple(stage_kwargs.items()))
    return generate(ds, job_processor(config, placement), options)
