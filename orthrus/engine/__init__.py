"""The streaming engine: request loop, slot table, device iterations, speculation policy, CUDA graphs."""
from orthrus.engine.engine import EngineStepError, OrthrusEngine
from orthrus.engine.requests import FinishReason, GenerationResult, RequestOutput

__all__ = ["EngineStepError", "FinishReason", "GenerationResult", "OrthrusEngine", "RequestOutput"]
