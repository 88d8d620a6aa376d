"""Ray Data batch-generation job around the Orthrus engine (uses only ``orthrus``' public API).

Flow: ``inputs`` (preflight) -> ``dataset`` (read_parquet -> ``preprocess`` tasks -> ``stage``
actors, which decode and then detokenize with ``postprocess``) -> ``output`` (exactly-once commits
by the driver) -> ``summary``; ``job`` ties them together; ``jobs/generate.py`` is the entry point.
"""
