"""EngineSettings: how one engine is built, every setting under its one name.

The same names run from a job's YAML (``engine.<name>``) and a processor's ``engine_kwargs`` to
``OrthrusEngine(...)`` and on to the scheduler and the model runner, which take the resolved record
instead of a dozen positional arguments. ``resolved`` fills what the model and the device decide
(block size, context limit, token budget) and checks every value, naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

DEFAULT_MAX_SEQ_LEN = 8192
# Tokens one step's AR forward computes at most (the running rows' blocks first, then prompt
# chunks): vLLM's ``max_num_batched_tokens``. On a GPU a larger forward still fills the device
# better; on a CPU 2,048 tokens is past the point where a bigger batch pays (the forward is
# compute-bound there), and it bounds how long running rows wait behind a long prompt.
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
ATTENTION_KERNELS = ("auto", "sdpa", "flash")
SPECULATIVE_MODES = (True, False, "auto")


@dataclass(frozen=True)
class EngineSettings:
    """How an engine is built (``OrthrusEngine``'s docstring says what each setting does).

    ``attention`` may also be an ``AttentionBackend`` instance. None means "the model's or the
    device's choice" until :meth:`resolved`."""

    max_batch_size: int = 8
    block_size: int | None = None
    max_seq_len: int | None = None
    attention: Any = "auto"              # "auto" | "sdpa" | "flash" | an AttentionBackend
    static_shapes: bool | None = None
    speculative: bool | str = True
    key_bucket: int | None = None
    prefix_cache: bool = True
    kv_cache_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    adaptive_verify: bool = True
    compile: bool | None = None          # inductor-compiled layer pieces (model/compiled.py); None = on for CUDA

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting's name (a job's engine section maps onto these by name)."""
        return tuple(f.name for f in fields(cls))

    def resolved(self, block_size: int, max_position_embeddings: int, device_type: str) -> EngineSettings:
        """These settings with the model's ``block_size`` and context limit and the device's token
        budget filled in where None, every value checked (``ValueError`` naming the field)."""
        self.check()                    # before ``compile`` becomes a bool
        out = replace(self, block_size=int(self.block_size if self.block_size is not None else block_size),
                      max_seq_len=int(self.max_seq_len if self.max_seq_len is not None
                                      else min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN)),
                      max_num_batched_tokens=self.max_num_batched_tokens if self.max_num_batched_tokens is not None
                      else DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cuda"]),
                      # On a GPU compiled kernels replace thousands of small launches; on a CPU the
                      # first compile costs minutes of a small machine for a modest gain (performance.md).
                      compile=bool(self.compile if self.compile is not None else device_type == "cuda"))
        out.check()
        return out

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting with a value the engine cannot take."""
        check_mode(self.speculative)
        if not _int(self.max_batch_size, 1):
            raise ValueError(f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        if self.block_size is not None and not _int(self.block_size, 2):
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft), got {self.block_size}")
        if self.max_seq_len is not None and not _int(self.max_seq_len, 2):
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if isinstance(self.attention, str) and self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true, false or None, got {self.compile!r}")
        if self.max_num_batched_tokens is not None and not _int(self.max_num_batched_tokens, 1):
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {self.max_num_batched_tokens!r}")


def check_mode(speculative: object) -> None:
    """Raise ``ValueError`` unless ``speculative`` is True, False or "auto"."""
    if speculative not in SPECULATIVE_MODES or not isinstance(speculative, (bool, str)):
        raise ValueError(f"speculative must be True, False or 'auto', got {speculative!r}")


def _int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
