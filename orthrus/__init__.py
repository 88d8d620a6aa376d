"""Orthrus: one Qwen3 model with an AR view and a diffusion view, batched lossless decoding.

Layout: ``orthrus.engine`` (the streaming request loop and everything it steps), ``orthrus.model``
(the dual-view Qwen3, attention backends, KV cache, checkpoints), ``orthrus.sampling`` (processing,
sampling and speculative acceptance), ``orthrus.params`` (request parameters and row statistics),
``orthrus.metrics`` (the acceptance metrics), ``orthrus.constraints`` (structured-output
constraints; their grammar masks live in ``orthrus.engine.host.grammar``). Training lives apart, in ``orthrus_train``.
"""
from orthrus.constraints import Constraint, ConstraintError
from orthrus.engine import EngineStats, EngineStepError, FinishReason, GenerationResult, KVPages, RequestOutput
from orthrus.engine.settings import EngineSettings
from orthrus.metrics import tokens_per_cycle
from orthrus.params import RowStats, SamplingParams
from orthrus.reasoning import ReasoningTokens

# Loaded on first use: the engine and the model import torch and transformers' model code (seconds
# of CPU), which a process that only builds requests or reads results never needs (the batch job's
# read and tokenization tasks, its driver). ``from orthrus import OrthrusEngine`` works as before.
# Relative names: the package may be imported under another name (``jobs/bench/ab.py`` loads an
# older copy beside this one), and each copy must load its own modules.
_LAZY = {"OrthrusEngine": ".engine.engine", "OrthrusForCausalLM": ".model",
         "check_structured": ".engine.host.grammar"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'orthrus' has no attribute {name!r}")


__all__ = ["Constraint", "ConstraintError", "EngineSettings", "EngineStats", "EngineStepError", "FinishReason", "GenerationResult", "KVPages", "OrthrusEngine", "OrthrusForCausalLM",
           "ReasoningTokens", "RequestOutput", "RowStats", "SamplingParams", "check_structured", "tokens_per_cycle"]
