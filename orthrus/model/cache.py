"""Ragged KV cache: static per-layer buffers, one committed length per row.

Shape legend
    B   slots (max batch size)          b   rows taking part in this forward (a subset of slots)
    Hk  key/value heads                 D   head dim
    S   capacity per slot (max_seq_len + block size: room for one scratch block past the context)
    T   tokens in this forward (1 for AR, K for a block, prompt length for prefill)

Why ragged: in a batch every row accepts its own number of drafts per cycle, so each row commits a
different number of tokens. Cropping is therefore a per-row length update (``lengths``) rather than
a copy; K/V beyond a row's length is stale, masked by the attention, and overwritten by the next
block written at that row's offset.

This is plain storage: how a forward appends to it and attends over it is an attention backend's
job (``backends.py``).
"""
from __future__ import annotations

import torch


class RaggedKVCache:
    """Per-layer K/V buffers ``[B, Hk, S, D]`` allocated once, plus ``lengths [B]`` on the device."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)  # committed tokens
        self.num_slots = num_slots
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Scatter a block's K/V ``[b, Hk, T, D]`` to each row's own ``positions [b, T]``."""
        # Advanced indices on dims 0 and 2 (split by a slice) put the broadcast dims first:
        # the target view is [b, T, Hk, D].
        rows = slots[:, None]
        self.k[layer][rows, :, positions] = k_new.transpose(1, 2)
        self.v[layer][rows, :, positions] = v_new.transpose(1, 2)

    def read(self, layer: int, slots: torch.Tensor | None, kv_len: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[b, Hk, kv_len, D]`` of the given slots (all slots, copy-free, when ``slots`` is None)."""
        if slots is None:
            return self.k[layer][:, :, :kv_len], self.v[layer][:, :, :kv_len]
        return self.k[layer][slots, :, :kv_len], self.v[layer][slots, :, :kv_len]

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first ``length`` positions of slots ``src [n]`` into slots ``dst [n]`` (shared prefill)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def reset(self) -> None:
        """Forget every row (buffers are not cleared: stale K/V is masked by ``lengths``)."""
        self.lengths.zero_()
