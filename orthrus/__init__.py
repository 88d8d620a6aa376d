"""Orthrus: one Qwen3 model with an AR view and a diffusion view, batched lossless decoding."""
from orthrus.engine import OrthrusEngine
from orthrus.model import OrthrusForCausalLM
from orthrus.params import GenerationResult, RowStats, SamplingParams

__all__ = ["OrthrusEngine", "OrthrusForCausalLM", "GenerationResult", "RowStats", "SamplingParams"]
