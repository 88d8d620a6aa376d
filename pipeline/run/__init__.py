"""Orchestration: preflight, the Ray Data graph, the driver's commit loop, resources, crash reports."""
