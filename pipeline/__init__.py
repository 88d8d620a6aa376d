"""Ray Data batch-generation job around the Orthrus engine (uses only ``orthrus``' public API).

Packages, lowest first (each imports only earlier ones; ``tests/unit/test_layering.py``):
``config`` and ``exceptions`` (Ray exception chains), ``tasks``, ``schema`` (the output columns and
the internal ones between stages), ``storage/`` (filesystems, the lease, model files), ``output/``
(parts, footers, resume, repairs), ``requests/`` (the sampling-field table, prompts, structured
output, the prepare step, error rows), ``inputs/`` (discovery, formats, staging, the read tasks, id
checks, the job's per-sample rows), ``actor/`` (the generation stage, its engine loop, metrics and
fault injection), ``processor/`` (the same generation as one stage of a user's own Ray Data
pipeline, ``build_orthrus_processor``), ``report/`` (summary, progress, throughput) and ``run/``
(preflight, the Ray Data graph, the driver's commit loop). ``jobs/generate.py`` is the job's entry
point.
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
