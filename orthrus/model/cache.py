"""Paged KV cache: per-layer page pools, one page table per slot, one committed length per row.

Shape legend
    B   slots (the most rows in flight)     b   rows taking part in this forward (a subset of slots)
    P   pages in the pool                   G   page size (tokens per page)
    M   page-table entries per slot         S   positions per slot (max_seq_len + block size), <= M * G
    Hk  key/value heads                     D   head dim
    T   tokens in this forward              L   keys attended

Why pages: a static ``[B, Hk, S, D]`` buffer holds every slot at the longest possible length, so
memory is slots x the longest row whatever the rows really hold. Here a row holds the pages its
tokens fill (the host allocator, ``engine/host/pages.py``, hands them out before each step), a page
can be shared by reference between rows with the same prompt prefix (the prefix cache), and the
rows in flight grow with the tokens they hold rather than with the longest row.

Why ragged: in a batch every row accepts its own number of drafts per cycle, so each row commits a
different number of tokens. Cropping is therefore a per-row length update (``lengths``) rather than
a copy; K/V beyond a row's length is stale, masked by the attention, and overwritten by the next
block written at that row's offset.

The null page (page 0): every table entry a row does not own points at it. Writes nobody reads go
there (the padding rows of a static iteration, a dead row's iteration, a prefill's pad tokens past
the pages its row owns) and reads past a row's pages land there, masked. The pool is zeroed at
allocation: a masked key's value still passes through ``weights @ V`` (weight 0), and 0 x NaN from
uninitialised memory would be NaN.

This is plain storage: how a forward appends to it and attends over it is an attention backend's
job (``backends.py``).
"""
from __future__ import annotations

import torch

NULL_PAGE = 0
PAGE_SIZE = 16   # tokens per page for SDPA (and the CPU): the prefix cache's sharing granularity


class PagedKVCache:
    """Per-layer pools ``[P, G, Hk, D]`` allocated once, the page table ``[B, M]`` int32 and
    ``lengths [B]`` (committed tokens) on the device."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, capacity: int,
                 num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pages_per_slot = -(-capacity // page_size)
        # int32: flash_attn's block_table type; gathers widen it to int64 where they index.
        self.table = torch.full((num_slots, self.pages_per_slot), NULL_PAGE, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_slots, self.capacity, self.page_size, self.num_pages = num_slots, capacity, page_size, num_pages

    @classmethod
    def contiguous(cls, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device | str, page_size: int = PAGE_SIZE) -> PagedKVCache:
        """Every slot owning its own ``M`` pages in order (the static layout as a page table): for
        tests and tools that drive the cache without the engine's allocator."""
        m = -(-capacity // page_size)
        cache = cls(num_layers, num_slots, num_kv_heads, head_dim, capacity, 1 + num_slots * m, page_size, dtype, device)
        cache.assign_contiguous()
        return cache

    def assign_contiguous(self) -> None:
        """Give slot s pages ``1 + s*M … (s+1)*M`` (the pool must hold them): a fixed layout for
        tools that drive the cache without the engine's allocator (tests, the forward profile)."""
        b, m = self.table.shape
        assert self.num_pages >= 1 + b * m, f"{self.num_pages} pages cannot give {b} slots {m} each"
        self.table.copy_(1 + torch.arange(b * m, dtype=torch.int32, device=self.table.device).view(b, m))

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token holds over all layers."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[2] * k.shape[3] * k.element_size()

    def index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool rows ``[b, T]`` (page * G + offset) of ``positions [b, T]`` of ``slots [b]``."""
        pages = self.table[slots[:, None], positions // self.page_size].long()       # [b, T]
        return pages * self.page_size + positions % self.page_size

    def write(self, layer: int, index: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Scatter a block's K/V ``[b, Hk, T, D]`` to the flat pool rows ``index [b, T]``."""
        flat = (-1, *self.k[layer].shape[2:])                                        # [P * G, Hk, D]
        rows = index.reshape(-1)                                                     # [b * T]
        # index_copy_ (several times faster than an advanced-index assignment on a CPU); repeated
        # rows occur only in the null page, whose content nobody reads
        self.k[layer].view(flat).index_copy_(0, rows, k_new.transpose(1, 2).reshape(flat))
        self.v[layer].view(flat).index_copy_(0, rows, v_new.transpose(1, 2).reshape(flat))

    def read(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[b, Hk, L, D]`` of positions ``0 … L-1`` (L = n * G) gathered page by page from the
        pages ``pages [b, n]`` (a row's first n table entries): one index per page, not per key."""
        b, n = pages.shape
        shape = (b, n * self.page_size, *self.k[layer].shape[2:])                   # [b, L, Hk, D]
        flat = pages.reshape(-1)     # index_select: ~4x faster than advanced indexing on a CPU
        return (self.k[layer].index_select(0, flat).view(shape).transpose(1, 2),
                self.v[layer].index_select(0, flat).view(shape).transpose(1, 2))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages ``src [c]`` into pages ``dst [c]`` in every layer (a shared prompt's partial page)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def set_entries(self, entries: torch.Tensor) -> None:
        """Apply the host allocator's page-table changes ``entries [c, 3]`` (slot, entry, page)."""
        self.table[entries[:, 0], entries[:, 1]] = entries[:, 2].to(torch.int32)

    def drop_dead(self, slots: torch.Tensor, alive: torch.Tensor) -> None:
        """Point the tables of dead rows among ``slots [b]`` at the null page: a dead row still runs
        in the iteration it died in (the host learns of it at the read), and its writes must not land
        in pages it may share with other rows. No host read."""
        self.table[slots] *= alive[:, None].to(torch.int32)

    def reset(self) -> None:
        """Forget every row (pools are not cleared: stale K/V is masked by ``lengths``)."""
        self.lengths.zero_()
        self.table.fill_(NULL_PAGE)
