"""Orthrus: one Qwen3 model with an AR view and a diffusion view, batched lossless decoding.

Layout: ``orthrus.engine`` (the streaming request loop and everything it steps), ``orthrus.model``
(the dual-view Qwen3, attention backends, KV cache, checkpoints), ``orthrus.sampling`` (processing,
sampling and speculative acceptance), ``orthrus.params`` (request parameters and row statistics),
``orthrus.metrics`` (the acceptance metrics), ``orthrus.constraints`` (structured-output
constraints; their grammar masks live in ``orthrus.engine.host.grammar``). Training lives apart, in ``orthrus_train``.
"""
from orthrus.constraints import Constraint, ConstraintError
from orthrus.engine import (EngineStats, EngineStepError, FinishReason, GenerationResult, KVPages, OrthrusEngine,
                            RequestOutput)
from orthrus.engine.host.grammar import check_structured
from orthrus.metrics import tokens_per_cycle
from orthrus.model import OrthrusForCausalLM
from orthrus.params import RowStats, SamplingParams
from orthrus.reasoning import ReasoningTokens

__all__ = ["Constraint", "ConstraintError", "EngineStats", "EngineStepError", "FinishReason", "GenerationResult", "KVPages", "OrthrusEngine", "OrthrusForCausalLM",
           "ReasoningTokens", "RequestOutput", "RowStats", "SamplingParams", "check_structured", "tokens_per_cycle"]
