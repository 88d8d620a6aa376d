"""Ray Data batch-generation job around the Orthrus engine (uses only ``orthrus``' public API).

Neighbourhoods: ``run/`` (preflight, the Ray Data graph, the driver's commit loop), ``rows/``
(reading inputs, building requests and error rows, the column contract), ``actor/`` (the
generation stage and its engine loop), ``output/`` (parts, footers, resume, repairs),
``storage/`` (filesystems, the lease, model files) and ``report/`` (summary, progress, metrics).
``jobs/generate.py`` is the entry point.
"""
