"""Orthrus: one Qwen3 model with an AR view and a diffusion view, batched lossless decoding."""
from orthrus.engine import EngineStepError, OrthrusEngine
from orthrus.model import OrthrusForCausalLM
from orthrus.params import RowStats, SamplingParams, tokens_per_cycle
from orthrus.requests import FinishReason, GenerationResult, RequestOutput

__all__ = ["EngineStepError", "FinishReason", "GenerationResult", "OrthrusEngine", "OrthrusForCausalLM",
           "RequestOutput", "RowStats", "SamplingParams", "tokens_per_cycle"]
