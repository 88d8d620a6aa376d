"""``build_orthrus_processor``: Orthrus generation as one lazy stage of a user's own Ray Data pipeline.

    ds = build_orthrus_processor(config, preprocess=..., postprocess=...)(ds)

The processor appends operators to the dataset it is given and returns the new (lazy) dataset:
``map(preprocess)`` -> prepare (chat template, tokenization, sampling; CPU tasks) -> re-cut into
``batch_size`` blocks -> generate + detokenize (an actor pool, one model each) -> ``map(postprocess)``.
It never writes, never calls ``ray.init`` and changes no process-wide Ray or Ray Data setting. The
batch job (``pipeline/run/dataset.py``) is built on the same function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pipeline.actor.stage import GenerationStage, StagePlan
from pipeline.processor.config import OrthrusProcessorConfig, processor_config
from pipeline.requests.prepare import PreparePlan, prepare_batch
from pipeline.requests.prompts import ChatTemplate

RowFn = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class StageOptions:
    """What the batch job adds to a processor (users get the defaults)."""

    batch_records: bool = False       # one ``__batch`` record per batch for the job's driver
    keep_inputs: bool = True          # False: the input columns the processor reads do not travel on
    prepared: bool = False            # True: rows arrive prepared (the job's own step); no prepare map
    stage_cls: type = GenerationStage
    stage_kwargs: tuple[tuple[str, Any], ...] = ()   # more constructor arguments (``actor/faults.py``)


def prepare_plan(config: OrthrusProcessorConfig, options: StageOptions = StageOptions()) -> PreparePlan:
    """The prepare stage's plan from the processor config."""
    use = {True: "on", False: "off", "auto": "auto"}[config.apply_chat_template]
    kwargs = tuple(sorted((config.chat_template_kwargs or {}).items()))
    return PreparePlan(config.model, config.storage, ChatTemplate(use, config.chat_template, kwargs), config.tokenize,
                       options.keep_inputs, group=grouping_on(config))


def grouping_on(config: OrthrusProcessorConfig) -> bool:
    """Prefix grouping, unless the user's DataContext asks Ray Data to preserve row order."""
    import ray.data

    return config.prefix_grouping and not ray.data.DataContext.get_current().execution_options.preserve_order


def stage_plan(config: OrthrusProcessorConfig, options: StageOptions) -> StagePlan:
    """The generation actors' constructor argument."""
    return StagePlan(model=config.model, engine=config.engine_kwargs, use_gpu=config.bundle["GPU"] > 0,
                     audit=config.audit, row_timeout_s=config.row_timeout_s,
                     storage=config.storage, detokenize=config.detokenize, batch_records=options.batch_records)


def _pool(concurrency: int | tuple[int, int], config: OrthrusProcessorConfig):
    import ray.data

    low, high = (concurrency, concurrency) if isinstance(concurrency, int) else concurrency
    # Several batches in flight per actor, all feeding its one engine: its slots stay busy across
    # batch boundaries (each batch still returns on its own).
    return ray.data.ActorPoolStrategy(min_size=low, max_size=high,
                                      max_tasks_in_flight_per_actor=config.max_concurrent_batches,
                                      max_concurrent_calls_per_actor=config.max_concurrent_batches)


def generate(ds, config: OrthrusProcessorConfig, options: StageOptions = StageOptions()):
    """Prepare -> re-cut -> generate on ``ds`` (rows in the processor's shape, or already prepared
    with ``options.prepared``); the lazy result."""
    if not options.prepared:
        ds = ds.map_batches(prepare_batch, fn_kwargs={"plan": prepare_plan(config, options)}, batch_format="pyarrow",
                            batch_size=config.prepare_window(config.batch_size))
    # Re-cut into batch-sized blocks so work spreads over the actors and each finished batch
    # leaves the pool while the rest run.
    ds = ds.repartition(target_num_rows_per_block=config.batch_size)
    bundle = config.bundle
    return ds.map_batches(
        options.stage_cls, fn_constructor_kwargs={"plan": stage_plan(config, options), **dict(options.stage_kwargs)},
        batch_size=config.batch_size, batch_format="pyarrow", compute=_pool(config.concurrency, config),
        num_gpus=bundle["GPU"], num_cpus=bundle["CPU"],
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
        accelerator_type=config.accelerator_type if config.accelerator_type not in (None, "GPU") else None)


class OrthrusProcessor:
    """A lazy ``Dataset -> Dataset`` callable (what :func:`build_orthrus_processor` returns)."""

    def __init__(self, config: OrthrusProcessorConfig, preprocess: RowFn | None, postprocess: RowFn | None) -> None:
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, ds):
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = generate(ds, self.config)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_orthrus_processor(config: OrthrusProcessorConfig | dict[str, Any], preprocess: RowFn | None = None,
                            postprocess: RowFn | None = None) -> OrthrusProcessor:
    """A processor for ``config`` (validated now: a bad field raises ``ConfigError`` naming it).

    ``preprocess`` maps each input row to the processor's shape (``messages`` or ``prompt``, and
    optionally ``sampling_params`` with vLLM's names); ``postprocess`` maps each output row (with
    ``generated_text``, ``generated_tokens``, ``num_input_tokens``, ``num_generated_tokens``,
    ``finish_reason``, ``error`` and the speculative-decoding statistics).
    """
    return OrthrusProcessor(processor_config(config), preprocess, postprocess)
