"""The streaming engine: ``engine.py`` steps a host scheduler (``host/``, no torch) and a device runner
(``device/``) through the records of ``step.py``; what comes back is in ``outputs.py``."""
from orthrus.engine.outputs import (EngineStats, EngineStepError, FinishReason, GenerationResult, KVPages,
                                    RequestOutput, TokenLogprobs)

__all__ = ["EngineStats", "EngineStepError", "FinishReason", "GenerationResult", "KVPages", "OrthrusEngine",
           "RequestOutput", "TokenLogprobs"]


def __getattr__(name: str):
    # The engine imports torch: loaded on first use, so the records of outputs.py stay light (orthrus/__init__.py).
    if name == "OrthrusEngine":
        from orthrus.engine.engine import OrthrusEngine
        return OrthrusEngine
    raise AttributeError(f"module 'orthrus.engine' has no attribute {name!r}")
