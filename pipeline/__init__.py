"""Ray Data batch-generation job around the Orthrus engine (uses only ``orthrus``' public API).

Neighbourhoods: ``run/`` (preflight, the Ray Data graph, the driver's commit loop), ``rows/``
(reading inputs, building requests and error rows, the column contract), ``actor/`` (the
generation stage and its engine loop), ``output/`` (parts, footers, resume, repairs),
``storage/`` (filesystems, the lease, model files) and ``report/`` (summary, progress, metrics).
``processor/`` is the same generation as one stage of a user's own Ray Data pipeline
(``build_orthrus_processor``); ``jobs/generate.py`` is the job's entry point.
"""
__all__ = ["OrthrusProcessorConfig", "build_orthrus_processor"]


def __getattr__(name: str):
    # Imported on first use: ``import pipeline.config`` (the job's CLI, preflight) stays free of torch.
    if name == "build_orthrus_processor":
        from pipeline.processor.build import build_orthrus_processor
        return build_orthrus_processor
    if name == "OrthrusProcessorConfig":
        from pipeline.processor.config import OrthrusProcessorConfig
        return OrthrusProcessorConfig
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
