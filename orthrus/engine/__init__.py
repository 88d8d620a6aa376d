"""The streaming engine: request loop, slot table, device iterations, speculation policy, CUDA graphs."""
from orthrus.engine.engine import OrthrusEngine
from orthrus.engine.requests import EngineStepError, FinishReason, GenerationResult, RequestOutput

__all__ = ["EngineStepError", "FinishReason", "GenerationResult", "OrthrusEngine", "RequestOutput"]
