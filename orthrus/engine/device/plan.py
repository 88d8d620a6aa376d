"""What the device kernels work on: the engine's device parts, and one iteration's shape."""
from __future__ import annotations

from dataclasses import dataclass

from orthrus.engine.device.proposer import Proposer
from orthrus.engine.device.slot_state import SlotState
from orthrus.engine.step import AR, SamplingPaths
from orthrus.model.backends import AttentionBackend
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM


@dataclass(frozen=True)
class DeviceParts:
    """The model, its KV cache, the attention backend, the draft proposer and the per-slot state:
    everything a kernel reads or writes (owned by the ``ModelRunner``)."""

    model: OrthrusForCausalLM
    cache: PagedKVCache
    backend: AttentionBackend
    proposer: Proposer
    state: SlotState
    max_seq_len: int


@dataclass(frozen=True)
class IterationPlan:
    """What shapes one iteration's device work; host-known and hashable (the CUDA-graph key, so no
    input that changes the work can be left out of the key: a hand-built key that forgot one would
    replay the wrong graph and give wrong tokens silently).

    ``block``: the cycle's block size K, or 0 (``AR``) for a plain AR step. ``rows``: rows of the
    forward (a padded bucket on the static path). ``all_slots``: the rows are every slot in order
    (copy-free cache reads). ``kv_len``: host-known bound on visible keys (on the static path a
    power of two with SDPA, ``graphs.key_bound``; the whole capacity with flash, which ignores it).
    ``paths``: the sampling fast paths. ``logprobs``: the top-k width of the logprob block, None = no
    row asked. ``constrained``: some row has a grammar (its masks come from the host during the
    iteration, so such an iteration is never captured). ``verify``: the drafts the cycle verifies in
    all, spread over its rows by the drafter's confidence (``verify_budget.py``; None: every draft).
    """

    block: int
    rows: int
    all_slots: bool
    kv_len: int
    paths: SamplingPaths
    logprobs: int | None
    constrained: bool = False
    verify: int | None = None

    @property
    def forward_tokens(self) -> int:
        """Token positions its forwards compute: a cycle's draft ``[rows, K]`` and verify (the
        anchors and ``verify`` drafts, or ``[rows, K]``), or an AR step's ``[rows, 1]``."""
        if self.block == AR:
            return self.rows
        return self.rows * self.block + (self.rows * self.block if self.verify is None else self.rows + self.verify)

    @property
    def width(self) -> int:
        """Emitted-token columns of its packed result (``packed.py``)."""
        return self.block if self.block != AR else 1
