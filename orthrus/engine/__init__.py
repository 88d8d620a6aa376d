"""The streaming engine: ``engine.py`` steps a host scheduler (``host/``, no torch) and a device runner
(``device/``) through the records of ``step.py``; what comes back is in ``outputs.py``."""
from orthrus.engine.engine import OrthrusEngine
from orthrus.engine.outputs import (EngineStats, EngineStepError, FinishReason, GenerationResult, KVPages,
                                    RequestOutput, TokenLogprobs)

__all__ = ["EngineStats", "EngineStepError", "FinishReason", "GenerationResult", "KVPages", "OrthrusEngine",
           "RequestOutput", "TokenLogprobs"]
