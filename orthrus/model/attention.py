"""Dual-view Qwen3 attention over the ragged cache.

Shape legend
    b   rows in this forward          T   query tokens per row
    H   query heads                   Hk  key/value heads (GQA: H is a multiple of Hk)
    D   head dim                      L   keys visible to this forward (kv_len, host-known bound)
    E   hidden size

Views. The AR view (``q_proj`` … ``k_norm``) is stock Qwen3. The diffusion view uses the ``*_diff``
twins with the same shapes. Both views share the cache: a forward writes its block's K/V at the
row's positions, then attends to every key ``j < key_limit[b, t]``:

    causal (AR, prefill, verify)    key_limit = position + 1
    bidirectional (draft block)     key_limit = lengths + T   (whole committed prefix + whole block)

The draft block's diffusion K/V lands in the scratch slots ``n … n+K-1`` that the verify pass
overwrites with AR K/V right after, so the diffusion view never leaves anything in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from orthrus.model import flash
from orthrus.model.cache import RaggedKVCache

AR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
DIFF_SUFFIX = "_diff"


@dataclass(frozen=True)
class BlockBatch:
    """Where a forward's tokens sit in the ragged cache and which keys each of them sees."""

    slots: torch.Tensor | None  # [b] cache slots; None = all B slots in order (copy-free reads)
    positions: torch.Tensor     # [b, T] absolute positions, also the cache write offsets
    key_limit: torch.Tensor     # [b, T] key j is visible iff j < key_limit
    kv_len: int                 # host-known bound: max(key_limit) <= kv_len <= capacity
    causal: bool = True         # False only for the draft block; the same rule as key_limit, for
                                # kernels that take lengths instead of a mask (flash.py)
    # Filled once per forward by ``prepare`` (not per layer): what every layer's kernel reads.
    mask: torch.Tensor | None = None         # [b, 1, T, L] bool: key j visible to query t (SDPA)
    write_slots: torch.Tensor | None = None  # [b] long: the cache slots the block is written to
    starts32: torch.Tensor | None = None     # [b] int32: each row's first position (flash)
    slots32: torch.Tensor | None = None      # [b] int32 or None (flash)

    def prepare(self, num_slots: int, flash_kernel: bool, key_bucket: int = 1, capacity: int | None = None
                ) -> "BlockBatch":
        """This batch with its per-forward tensors computed once for all layers.

        ``key_bucket`` > 1 rounds the attended key length up to a multiple of it (capped at
        ``capacity``): the extra keys are masked, so no token changes, and the eager GPU path sees a
        few key lengths instead of a new one almost every iteration (kernel plans are per shape).
        """
        if flash_kernel:
            return replace(self, starts32=self.positions[:, 0].to(torch.int32),
                           slots32=None if self.slots is None else self.slots.to(torch.int32))
        kv_len = self.kv_len
        if key_bucket > 1:
            kv_len = min(-(-kv_len // key_bucket) * key_bucket, capacity or kv_len)
        keys = torch.arange(kv_len, device=self.positions.device)
        mask = (keys[None, None, :] < self.key_limit[:, :, None])[:, None]         # [b, 1, T, L]
        return replace(self, kv_len=kv_len, mask=mask, write_slots=self.slot_index(num_slots))

    def slot_index(self, num_slots: int) -> torch.Tensor:
        """The slots as a tensor, materialising ``arange(B)`` for the all-slots case."""
        if self.slots is not None:
            return self.slots
        return torch.arange(num_slots, device=self.positions.device)


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_limit: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of ``q [b, H, T, D]`` over ``k, v [b, Hk, L, D]`` with per-row, per-query key limits
    (``mask [b, 1, T, L]``: the same rule, computed once per forward by ``BlockBatch.prepare``)."""
    if mask is None:
        keys = torch.arange(k.shape[2], device=q.device)
        mask = (keys[None, None, :] < key_limit[:, :, None])[:, None]  # [b, 1, T, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out                                                         # [b, H, T, D]


class OrthrusAttention(nn.Module):
    """Qwen3 attention with a second, identically shaped set of weights for the diffusion view."""

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
            setattr(self, "q_norm" + suffix, Qwen3RMSNorm(d, eps=config.rms_norm_eps))
            setattr(self, "k_norm" + suffix, Qwen3RMSNorm(d, eps=config.rms_norm_eps))

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

    def output(self, attn: torch.Tensor, diffusion: bool) -> torch.Tensor:
        """``[b, H, T, D]`` → ``[b, T, E]`` through the view's output projection."""
        b, _, t, _ = attn.shape
        return self._part("o_proj", diffusion)(attn.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: RaggedKVCache, batch: BlockBatch, diffusion: bool) -> torch.Tensor:
        """Write this block's K/V into the cache, then attend over the row's visible keys."""
        q, k, v = self.project(x, cos, sin, diffusion)
        if cache.flash_kernel is not None:   # one fused append + attend, bounded by each row's length
            out = flash.kvcache_attention(q, k, v, cache.k[self.layer_idx], cache.v[self.layer_idx],
                                          batch.starts32, batch.slots32, batch.causal, self.scale,
                                          cache.flash_kernel)
            return self.output(out, diffusion)
        cache.write(self.layer_idx, batch.write_slots, batch.positions, k, v)
        k_all, v_all = cache.read(self.layer_idx, batch.slots, batch.kv_len)  # [b, Hk, L, D]
        return self.output(ragged_attention(q, k_all, v_all, batch.key_limit, self.scale, batch.mask), diffusion)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor | None, diffusion: bool = False) -> torch.Tensor:
        """Whole-sequence attention without a cache; ``mask [b|1, 1, T, T]`` bool, None = causal."""
        q, k, v = self.project(x, cos, sin, diffusion)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.output(out, diffusion)
