"""Attention backends: how one layer's queries meet their keys, for every kind of forward.

Shape legend
    b   rows in this forward          T   query tokens per row
    H   query heads                   Hk  key/value heads (GQA: H is a multiple of Hk)
    D   head dim                      L   keys attended (kv_len, a host-known bound, or T for dense)
    B   cache slots                   M   page-table entries per slot (``cache.py``)

The model has one layer loop (``OrthrusModel.forward``); what differs between inference, the plain
AR forward and training is only the ``Attend`` it is given: a callable
``attend(layer_idx, q [b, H, T, D], k, v [b, Hk, T, D], scale) -> [b, H, T, D]`` made once per
forward. Cached (inference) forwards get theirs from an ``AttentionBackend`` bound to the paged
cache and a ``BlockBatch``; dense forwards use ``DenseSDPA`` (causal or an explicit mask) and
training its dual-pass mask (``orthrus_train.training.DualPassAttention``), Attend objects as such.

Visibility in a cached forward (positions of a row are consecutive: ``start + arange(T)``):

    causal (AR, prefill, verify)    query at position p sees keys j <= p
    bidirectional (draft block)     every query sees keys j < start + T  (whole prefix + whole block)

The draft block's diffusion K/V lands in the scratch positions ``n … n+K-1`` that the verify pass
overwrites with AR K/V right after, so the diffusion view never leaves anything in the cache.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from orthrus.model import flash
from orthrus.model.cache import PAGE_SIZE, PagedKVCache


class Attend(Protocol):
    """One forward's attention, called by every layer: ``q [b, H, T, D]``, new ``k, v [b, Hk, T, D]``."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        ...


@dataclass(frozen=True)
class BlockBatch:
    """Where a forward's tokens sit in the paged cache and which keys each of them sees."""

    slots: torch.Tensor | None  # [b] cache slots; None = all B slots in order
    positions: torch.Tensor     # [b, T] absolute positions (consecutive per row), the cache write offsets
    kv_len: int                 # host-known bound on the keys any query sees: max(positions) < kv_len <= S
    causal: bool = True         # False only for the draft block (see the module docstring)
    # Filled once per forward by the backend's ``prepare`` (not per layer): what every layer reads.
    mask: torch.Tensor | None = None         # [b, 1, T, L] bool: key j visible to query t (SDPA)
    write_index: torch.Tensor | None = None  # [b, T] long: the pool rows the block is written to (SDPA)
    key_pages: torch.Tensor | None = None    # [b, L / G] long: the pages of keys 0 … L-1 (SDPA)
    starts32: torch.Tensor | None = None     # [b] int32: each row's first position (flash)
    pages32: torch.Tensor | None = None      # [b, M] int32: the rows' page tables (flash)

    def slot_index(self, num_slots: int) -> torch.Tensor:
        """The slots as a tensor, materialising ``arange(B)`` for the all-slots case."""
        if self.slots is not None:
            return self.slots
        return torch.arange(num_slots, device=self.positions.device)


def visible_keys(positions: torch.Tensor, causal: bool, kv_len: int) -> torch.Tensor:
    """The visibility rule as a mask ``[b, 1, T, L]`` over keys ``0 … kv_len-1``."""
    t = positions.shape[1]
    limit = positions + 1 if causal else (positions[:, :1] + t).expand_as(positions)   # [b, T]: j < limit
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, None, :] < limit[:, :, None])[:, None]                            # [b, 1, T, L]


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """SDPA of ``q [b, H, T, D]`` over ``k, v [b, Hk, L, D]`` with ``mask [b, 1, T, L]`` → ``[b, H, T, D]``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


class AttentionBackend(ABC):
    """How a cached forward appends its block's K/V to the paged cache and attends over it."""

    name: ClassVar[str]
    page_size: ClassVar[int]   # the cache's page size this backend's kernel needs

    @abstractmethod
    def prepare(self, batch: BlockBatch, cache: PagedKVCache) -> BlockBatch:
        """``batch`` with the per-forward tensors its ``attend`` reads, made once for all layers."""

    @abstractmethod
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache, batch: BlockBatch, scale: float) -> torch.Tensor:
        """Write ``k, v [b, Hk, T, D]`` at the rows' positions, then attend ``q [b, H, T, D]``
        over the visible keys → ``[b, H, T, D]``."""

    def bind(self, batch: BlockBatch, cache: PagedKVCache) -> Attend:
        """One forward's ``Attend`` over ``cache``: ``batch`` prepared once, shared by every layer."""
        prepared = self.prepare(batch, cache)

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
            return self.attend(layer_idx, q, k, v, cache, prepared, scale)
        return attend


@dataclass(frozen=True)
class RaggedSDPA(AttentionBackend):
    """Scatter the block into the rows' pages, gather keys ``< kv_len`` back and run masked SDPA.

    ``key_bucket`` > 1 rounds the attended key length up to a multiple of it (capped at the cache
    capacity): the extra keys are masked, so no token changes, and the eager GPU path sees a few key
    lengths instead of a new one almost every iteration (kernel plans are built per shape).
    """

    key_bucket: int = 1
    name: ClassVar[str] = "sdpa"
    page_size: ClassVar[int] = PAGE_SIZE

    def prepare(self, batch: BlockBatch, cache: PagedKVCache) -> BlockBatch:
        kv_len = batch.kv_len
        if self.key_bucket > 1:
            kv_len = min(-(-kv_len // self.key_bucket) * self.key_bucket, cache.capacity)
        # Keys are read whole pages at a time (one gather index per page): the bound rounds up to a
        # page, and the keys past a row's limit are masked like any other.
        pages = -(-kv_len // cache.page_size)
        slots = batch.slot_index(cache.num_slots)
        return replace(batch, kv_len=pages * cache.page_size,
                       mask=visible_keys(batch.positions, batch.causal, pages * cache.page_size),
                       write_index=cache.index(slots, batch.positions),
                       key_pages=cache.table[slots, :pages].long())

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache, batch: BlockBatch, scale: float) -> torch.Tensor:
        cache.write(layer_idx, batch.write_index, k, v)
        k_all, v_all = cache.read(layer_idx, batch.key_pages)                    # [b, Hk, L, D]
        return ragged_attention(q, k_all, v_all, batch.mask, scale)


@dataclass(frozen=True)
class FlashKVCache(AttentionBackend):
    """One fused append + attend per layer (``flash.kvcache_attention``), bounded by each row's own
    length: no mask and no key bound, which keeps steady-state shapes static for CUDA graphs."""

    kernel: flash.KVCacheKernel   # flash_attn_with_kvcache or a function with its contract
    name: ClassVar[str] = "flash"
    page_size: ClassVar[int] = flash.PAGE_SIZE

    def prepare(self, batch: BlockBatch, cache: PagedKVCache) -> BlockBatch:
        pages = cache.table if batch.slots is None else cache.table[batch.slots]            # [b, M] int32
        return replace(batch, starts32=batch.positions[:, 0].to(torch.int32), pages32=pages)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: PagedKVCache, batch: BlockBatch, scale: float) -> torch.Tensor:
        return flash.kvcache_attention(q, k, v, cache.k[layer_idx], cache.v[layer_idx], batch.starts32,
                                       batch.pages32, batch.causal, scale, self.kernel)


def choose_backend(attention: str, device: torch.device, dtype: torch.dtype, num_heads: int,
                   num_kv_heads: int, head_dim: int, key_bucket: int = 1) -> AttentionBackend:
    """The backend for ``attention`` ("auto" | "sdpa" | "flash"; see ``flash.choose``, which may
    raise ``ValueError`` or warn and fall back to SDPA); ``key_bucket`` applies to SDPA only."""
    kernel = flash.choose(attention, device, dtype, num_heads, num_kv_heads, head_dim)
    return RaggedSDPA(key_bucket) if kernel is None else FlashKVCache(kernel)


@dataclass(frozen=True, eq=False)
class DenseSDPA:
    """Whole-sequence attention without a cache (an ``Attend``): causal, or ``mask [b|1, 1, T, T]`` bool."""

    mask: torch.Tensor | None = None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])
