"""Dual-view Qwen3 attention: the projections of both views; the attention itself is pluggable.

Shape legend
    b   rows in this forward          T   query tokens per row
    H   query heads                   Hk  key/value heads (GQA: H is a multiple of Hk)
    D   head dim                      E   hidden size

Views. The AR view (``q_proj`` … ``k_norm``) is stock Qwen3. The diffusion view uses the ``*_diff``
twins with the same shapes. Which keys a query sees, and whether the block's K/V goes into a cache,
is the ``attend`` callable's business (``backends.py``): the same module serves inference over the
ragged cache, the plain AR forward and training.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from orthrus.model.layers import RMSNorm, apply_rotary_pos_emb

AR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
DIFF_SUFFIX = "_diff"


def merge_heads(attn: torch.Tensor) -> torch.Tensor:
    """Attention's output ``[b, H, T, D]`` as ``[b, T, H*D]`` (the output projection's input)."""
    b, _, t, _ = attn.shape
    return attn.transpose(1, 2).reshape(b, t, -1)


class OrthrusAttention(nn.Module):
    """Qwen3 attention with a second, identically shaped set of weights for the diffusion view: its
    projections only (:meth:`project` before attention, :meth:`project_out` after). The decoder layer
    calls ``attend`` between them (``qwen3.OrthrusDecoderLayer``), so the work on either side can be
    compiled apart from the attention that writes the cache (``compiled.py``)."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scale = self.head_dim ** -0.5
        e, h, hk, d, bias = (config.hidden_size, self.num_heads, self.num_kv_heads,
                             self.head_dim, config.attention_bias)
        for suffix in ("", DIFF_SUFFIX):
            setattr(self, "q_proj" + suffix, nn.Linear(e, h * d, bias=bias))
            setattr(self, "k_proj" + suffix, nn.Linear(e, hk * d, bias=bias))
            setattr(self, "v_proj" + suffix, nn.Linear(e, hk * d, bias=bias))
            setattr(self, "o_proj" + suffix, nn.Linear(h * d, e, bias=bias))
            setattr(self, "q_norm" + suffix, RMSNorm(d, eps=config.rms_norm_eps))
            setattr(self, "k_norm" + suffix, RMSNorm(d, eps=config.rms_norm_eps))

    def _part(self, name: str, diffusion: bool) -> nn.Module:
        return getattr(self, name + (DIFF_SUFFIX if diffusion else ""))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, diffusion: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[b, H, T, D]`` and K, V ``[b, Hk, T, D]`` of one view, RoPE applied."""
        b, t, _ = x.shape
        q = self._part("q_proj", diffusion)(x).view(b, t, -1, self.head_dim)
        k = self._part("k_proj", diffusion)(x).view(b, t, -1, self.head_dim)
        v = self._part("v_proj", diffusion)(x).view(b, t, -1, self.head_dim)
        q = self._part("q_norm", diffusion)(q).transpose(1, 2)
        k = self._part("k_norm", diffusion)(k).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v.transpose(1, 2)

    def project_out(self, merged: torch.Tensor, diffusion: bool) -> torch.Tensor:
        """The view's output projection of ``merged [b, T, H*D]`` → ``[b, T, E]``."""
        return self._part("o_proj", diffusion)(merged)
