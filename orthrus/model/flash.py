"""FlashAttention's KV-cache kernel: the GPU form of ``backends.ragged_attention`` (docs/design.md §3.2).

Shape legend
    P   pages in the pool    G   page size (PAGE_SIZE)      M   page-table entries per row
    b   rows of this forward T   query tokens per row
    H   query heads          Hk  key/value heads            D   head dim

``flash_attn_with_kvcache(q, k_cache, v_cache, k=, v=, cache_seqlens=n, block_table=pages)``
writes each row's new K/V at positions ``n[b] … n[b]+T-1`` of its pages ``pages[b]`` (position p
lives in page ``pages[b, p // G]`` at offset ``p % G``) and attends over keys ``0 … n[b]+T-1`` in
one kernel, reading no further than each row's own length: no mask tensor and no ``kv_len`` bound,
which is what lets the steady-state cycle keep static shapes for CUDA graphs.
Its ``causal`` mask is aligned to the bottom-right corner, so with the block at the end of the
keys it is exactly our rules:

    causal=True   (prefill, verify, AR)  query t sees keys j <= n + t
    causal=False  (draft block)          query t sees keys j <  n + T  (whole prefix + whole block)

Layout: the pool is ``[P, G, Hk, D]``, the kernel's own paged layout; flash-attn 2 needs pages of
a multiple of 256 tokens with a ``block_table`` (``PAGE_SIZE``), and an int32 table.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

try:  # the CUDA package; absent on CPU machines (and from this project's CI)
    from flash_attn import flash_attn_with_kvcache as _kernel
except ImportError:  # pragma: no cover - depends on the machine
    _kernel = None

FLASH_DTYPES = (torch.float16, torch.bfloat16)
PAGE_SIZE = 256   # flash-attn 2's paged KV cache takes pages of a multiple of 256 tokens
KVCacheKernel = Callable[..., torch.Tensor]


def kernel() -> KVCacheKernel | None:
    """The importable ``flash_attn_with_kvcache``, or None."""
    return _kernel


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the flash kernel cannot serve this device/dtype (None when it can)."""
    if _kernel is None:
        return "the flash_attn package is not importable"
    if device.type != "cuda":
        return f"it needs a CUDA device (model is on {device})"
    if dtype not in FLASH_DTYPES:
        return f"it needs float16 or bfloat16 weights (model is {dtype})"
    return None


def kvcache_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, starts: torch.Tensor, pages: torch.Tensor, causal: bool,
                      scale: float, fn: KVCacheKernel) -> torch.Tensor:
    """Append ``k_new, v_new [b, Hk, T, D]`` at ``starts [b]`` and attend ``q [b, H, T, D]`` → ``[b, H, T, D]``.

    ``k_cache, v_cache [P, G, Hk, D]`` are updated in place; ``pages [b, M]`` are the rows' page
    tables. ``starts`` and ``pages`` are int32 (``FlashKVCache.prepare``).
    """
    out = fn(q.transpose(1, 2),                                    # [b, T, H, D]
             k_cache, v_cache,                                      # [P, G, Hk, D]
             k=k_new.transpose(1, 2), v=v_new.transpose(1, 2),      # [b, T, Hk, D]
             cache_seqlens=starts, block_table=pages,               # int32, made once per forward
             softmax_scale=scale, causal=causal)
    return out.transpose(1, 2)                                      # [b, H, T, D]


def choose(attention: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
           head_dim: int) -> KVCacheKernel | None:
    """The kernel an engine with ``attention`` ("auto" | "sdpa" | "flash") uses, or None for SDPA.

    'flash' where it cannot run raises ``ValueError``. 'auto' takes flash only after one probe call
    succeeds: a package that imports but cannot run here (a stub, a build for another GPU) would
    otherwise fail at the first forward; it falls back to SDPA with a warning instead.
    """
    why_not = unavailable_reason(device, dtype)
    if attention == "flash" and why_not:
        raise ValueError(f"attention='flash' is unavailable: {why_not}")
    fn = kernel() if attention != "sdpa" and not why_not else None
    if fn is not None and attention == "auto":
        failure = probe(fn, device, dtype, heads, kv_heads, head_dim)
        if failure is not None:
            warnings.warn(f"attention='auto': flash_attn is importable but failed a probe call ({failure}); "
                          "using SDPA", stacklevel=4)   # the engine's caller (via choose_backend)
            return None
    return fn


def probe(fn: KVCacheKernel, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
          head_dim: int) -> str | None:
    """One tiny call of ``fn`` with this model's head layout → None if it ran, else why it failed."""
    try:
        cache = torch.zeros((2, PAGE_SIZE, kv_heads, head_dim), dtype=dtype, device=device)   # [P, G, Hk, D]
        q = torch.zeros((1, heads, 1, head_dim), dtype=dtype, device=device)
        new = torch.zeros((1, kv_heads, 1, head_dim), dtype=dtype, device=device)
        start = torch.zeros(1, dtype=torch.int32, device=device)
        pages = torch.ones((1, 1), dtype=torch.int32, device=device)
        kvcache_attention(q, new, new, cache, cache.clone(), start, pages, True, head_dim ** -0.5, fn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # an asynchronous kernel error surfaces here, not later
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(e).__name__}: {e}"[:300]
    return None
