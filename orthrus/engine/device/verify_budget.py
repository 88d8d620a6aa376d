"""A step's verify budget, spent where the drafter expects acceptance (device side, no host read).

Shape legend
    b   rows of the iteration      K   block size (the anchor and K-1 drafts)
    V   drafts the step verifies in all (host-known: the budget)      N = b + V   verify tokens

Why: a row accepts 1.3-1.6 of its 7 drafts per cycle on the bundled model, so a verify forward over
every draft computes mostly positions that are thrown away, and at large batch the forward is
compute bound. The drafter says where: the chance that drafts 1 … j all pass is about the product
of its top probabilities up to j (vLLM's adaptive verification uses the same signal). The host
chooses how many drafts the step verifies in all (``host/verify_policy.py``, from measured step
costs); here those ``V`` go to the ``V`` best (row, draft) cells by that product. The product
never grows along a row, so each row gets a prefix of its drafts: verifying a prefix is ordinary
speculative decoding on a shorter block, exact for greedy and sampled rows alike, because the
widths depend on the drafter's distributions, never on the drafts drawn from them.

The verify forward then runs over exactly the ``N`` chosen tokens as one flat batch
(``model/ragged.py``): one attention group over the ``[b, K]`` block, whose cells past a row's
width repeat its last verified token (``take``) and are dropped again (``put``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def confidences(q_logits: torch.Tensor) -> torch.Tensor:
    """The drafter's top probability at each draft, ``q_logits [b, K-1, V]`` → ``[b, K-1]`` float32
    (before temperature and filters: one signal for greedy and sampled rows alike). Reduced in the
    logits' own dtype: a float32 copy of ``[b, K-1, V]`` would be GiBs at Qwen3's vocabulary, and the
    signal only ranks drafts (any rounding moves speed, never tokens)."""
    return (q_logits.amax(-1).float() - q_logits.logsumexp(-1).float()).exp()


def widths(conf: torch.Tensor, useful: torch.Tensor, budget: int) -> torch.Tensor:
    """How many drafts each row verifies, ``[b]`` summing to ``budget`` (at most b·(K-1)): the
    ``budget`` cells of highest cumulative confidence ``conf [b, K-1]``, where ``useful [b, K-1]``
    cells (a live row's drafts it could still emit) come before any other."""
    score = torch.where(useful, conf.cumprod(-1), -1.0)                     # non-increasing along a row
    # stable: of equal scores the earlier cell (row-major) wins, so each row's choice stays a prefix
    order = score.flatten().neg().sort(stable=True).indices[:budget]       # [V] chosen cells
    rows = torch.div(order, conf.shape[1], rounding_mode="floor")
    return torch.zeros(conf.shape[0], dtype=torch.long, device=conf.device).scatter_add_(
        0, rows, torch.ones_like(rows))


@dataclass(frozen=True)
class VerifyLayout:
    """Where each row's verified tokens sit in the flat verify batch: row i holds flat tokens
    ``[offset_i, offset_i + width_i]`` (its anchor and ``width [b]`` drafts); ``take [b*K]``: the flat
    token each cell of the ``[b, K]`` block reads (past the width: the row's last one), ``put [N]``:
    the cell of each flat token."""

    width: torch.Tensor
    take: torch.Tensor
    put: torch.Tensor

    @classmethod
    def of(cls, width: torch.Tensor, k: int, budget: int) -> VerifyLayout:
        """The layout of rows verifying ``width [b]`` drafts (summing to ``budget``) of a K block."""
        b, n = width.shape[0], width.shape[0] + budget
        lens = width + 1
        offset = (lens.cumsum(0) - lens)[:, None]                           # [b, 1]
        cell = torch.arange(k, device=width.device)[None, :]               # [1, K]
        take = offset + torch.minimum(cell, width[:, None])                 # [b, K]
        # each real cell names its flat token; the others all land on a spare slot n, dropped after
        dest = torch.where(cell <= width[:, None], offset + cell, n)
        ids = torch.arange(b * k, device=width.device)
        put = torch.empty(n + 1, dtype=torch.long, device=width.device).scatter_(0, dest.flatten(), ids)
        return cls(width, take.flatten(), put[:n])

    def flat(self, block: torch.Tensor) -> torch.Tensor:
        """A ``[b, K, …]`` tensor's verified cells as ``[N, …]``."""
        return block.flatten(0, 1).index_select(0, self.put)

    def cells(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N, …]`` back on the ``[b, K, …]`` block (cells past a width repeat the row's last)."""
        return flat.index_select(0, self.take).unflatten(0, (self.width.shape[0], -1))
