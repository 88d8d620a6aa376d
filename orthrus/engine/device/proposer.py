"""Draft proposers: who fills the K-1 masked positions of a block.

The engine only needs proposal logits; the default is the model's own diffusion view. Tests plug
in other proposers (e.g. replaying the AR continuation with chosen corruptions) to drive the
acceptance bookkeeping through every accept length.
"""
from __future__ import annotations

from typing import Protocol

import torch

from orthrus.model.backends import AttentionBackend, BlockBatch
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM


class Proposer(Protocol):
    """Returns proposal logits ``[b, K-1, V]`` for positions ``n+1 … n+K-1`` of each row."""

    def propose(self, anchor: torch.Tensor, batch: BlockBatch, cache: PagedKVCache,
                slots: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``anchor [b]`` sits at ``batch.positions[:, 0]``; ``slots [b]`` are the rows' slots (a test
        proposer maps them to its requests on its side); ``backend`` is the engine's, for proposers
        that run the model over ``cache``."""
        ...


class DiffusionProposer:
    """One diffusion-view forward over ``[a, M, …, M]``; every block position sees the whole block."""

    def __init__(self, model: OrthrusForCausalLM) -> None:
        self.model = model
        self.mask_token_id = model.mask_token_id

    def propose(self, anchor: torch.Tensor, batch: BlockBatch, cache: PagedKVCache,
                slots: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        k = batch.positions.shape[1]
        block = torch.full((anchor.shape[0], k), self.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor                                                  # [b, K]
        hidden = self.model.forward_cached(block, cache, batch, diffusion=True, backend=backend)
        return self.model.logits(hidden[:, : k - 1])                          # [b, K-1, V]
