"""Ragged forwards: the layer stack over one flat token batch, attention per row over its own pages.

Shape legend
    N   tokens in the forward (every row's tokens, back to back, no padding)
    g   rows of one attention group        T   query tokens per row of that group (its longest row)
    H   query heads      Hk  key/value heads      D   head dim      E   hidden size

Why flat: a padded ``[rows, T]`` forward computes every projection and MLP for pad tokens too; a
prefill right-padded to its longest prompt rest (prompts log-uniform in 16–2,048 tokens) computes
several times the tokens it needs. Here the linear layers see the ``N`` real tokens as one
``[1, N, E]`` sequence (``OrthrusModel.forward`` runs unchanged, RoPE from per-token positions),
and only attention meets rows: the tokens are split into *groups* of rows (contiguous in the flat
order), each gathered into a ``[g, H, T, D]`` block for the backend's paged attention and scattered
back. The host plans groups so that a row is never padded to more than about twice its length
(``host/admission.py``); a group of equal rows (a cycle's ``[b, K]`` block) is a view, no copy.

A pad query repeats its row's last real token and its key/value are written at the positions after
the row's last token (the host keeps ``start + T`` within the slot's capacity): positions the row has not committed,
overwritten before anything reads them, or the null page past the pages it owns (``cache.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orthrus.model.backends import AttentionBackend, BlockBatch
from orthrus.model.cache import PagedKVCache


@dataclass(frozen=True)
class AttentionGroup:
    """Rows ``slots [g]`` whose tokens are flat ``[first, first + count)``, attended as ``[g, T]``:
    ``positions [g, T]`` (each row's ``start + arange(T)``), ``take [g*T]`` the flat index
    (within the group) each padded cell reads and ``put [count]`` the padded cell of each real
    token (both None: the group is exactly ``[g, T]``, no padding); ``kv_len`` bounds its keys."""

    slots: torch.Tensor
    positions: torch.Tensor
    first: int
    count: int
    kv_len: int
    take: torch.Tensor | None = None
    put: torch.Tensor | None = None


@dataclass(frozen=True)
class RaggedBatch:
    """One flat forward over the paged cache: ``positions [N]`` per token and its attention groups
    (in flat order, covering every token once)."""

    positions: torch.Tensor
    groups: tuple[AttentionGroup, ...]


def ragged_attend(batch: RaggedBatch, cache: PagedKVCache, backend: AttentionBackend, causal: bool = True):
    """The ``Attend`` of a flat forward ``[1, N]``: per group, gather its rows into ``[g, H, T, D]``,
    run the backend's paged attention (which writes their K/V), scatter the result back."""
    prepared = [backend.prepare(BlockBatch(g.slots, g.positions, g.kv_len, causal), cache) for g in batch.groups]

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))                 # [N, H|Hk, D]
        outs = []
        for g, bb in zip(batch.groups, prepared):
            rows, t = g.positions.shape
            qg, kg, vg = (_rows(x[g.first: g.first + g.count], g.take, rows, t) for x in (q, k, v))
            out = backend.attend(layer_idx, qg, kg, vg, cache, bb, scale)   # [g, H, T, D]
            out = out.transpose(1, 2).reshape(rows * t, out.shape[1], out.shape[3])   # [g*T, H, D]
            outs.append(out if g.put is None else out.index_select(0, g.put))
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)                # [N, H, D]
        return flat.transpose(0, 1)[None]                                    # [1, H, N, D]
    return attend


def _rows(x: torch.Tensor, take: torch.Tensor | None, rows: int, t: int) -> torch.Tensor:
    """A group's flat tokens ``[n, h, D]`` as ``[g, h, T, D]`` (padded through ``take``)."""
    if take is not None:
        x = x.index_select(0, take)
    return x.view(rows, t, *x.shape[1:]).transpose(1, 2)


def pad_layout(lens: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Host side of a group whose rows compute ``lens`` tokens each: ``take [g*T]`` and ``put [sum]``
    (see :class:`AttentionGroup`), or None when every row has ``T = max(lens)`` tokens (a view)."""
    t = max(lens)
    if all(n == t for n in lens):
        return None
    length = np.asarray(lens, dtype=np.int64)[:, None]                      # [g, 1]
    offsets = np.cumsum(length, axis=0) - length                            # [g, 1] each row's first flat token
    cell = np.arange(t, dtype=np.int64)[None, :]                            # [1, T]
    take = (offsets + np.minimum(cell, length - 1)).reshape(-1)             # [g*T]
    put = (np.arange(len(lens), dtype=np.int64)[:, None] * t + cell)[cell < length]   # [sum(lens)]
    return take, put
