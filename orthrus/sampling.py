"""Logit processing, inverse-CDF sampling and vectorised speculative acceptance over ``[b, K]``.

Shape legend: b rows, T positions per row, K block size, V vocabulary.

Losslessness rests on two rules (DESIGN §2.2): the target ``p`` (AR view) and the proposal ``q``
(diffusion view) go through the *same* processing, and every draft is drawn from its own ``q``
independently of the others, so the accept/residual rule below is standard speculative sampling.
Greedy rows use one-hot distributions, for which the same rule reduces to "accept while the draft
equals the AR argmax, then emit the AR argmax".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row processing parameters on the device (gathered for the rows of one forward)."""

    temperature: torch.Tensor  # [b] float; ignored where greedy
    top_k: torch.Tensor        # [b] long; 0 = off
    top_p: torch.Tensor        # [b] float; 1 = off
    greedy: torch.Tensor       # [b] bool
    filtered: bool             # host-known: any row uses top-k or top-p (skips the sort otherwise)
    all_greedy: bool = False   # host-known: every row is greedy (argmax fast path, no probabilities)


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on tempered logits ``[b, T, V]``; removed entries become -inf."""
    b, t, v = x.shape
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).clamp(max=v)
    kth = sorted_x.gather(-1, (k - 1)[:, None, None].expand(b, t, 1))       # [b, T, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))           # ties with the k-th stay
    sp = sorted_x.softmax(-1)
    mass_before = sp.cumsum(-1) - sp                                         # strictly higher ranks
    drop_sorted = mass_before >= top_p[:, None, None].to(sp.dtype)           # rank 0 is always kept
    drop_sorted |= sorted_x == float("-inf")
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def process(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logits ``[b, T, V]`` → probabilities ``[b, T, V]``: temperature, top-k, top-p, softmax."""
    x = logits.to(_work_dtype(logits))
    if st.all_greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    onehot = torch.zeros_like(x).scatter(-1, x.argmax(-1, keepdim=True), 1.0)
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature).to(x.dtype)
    x = x / temp[:, None, None]
    if st.filtered:
        x = _filter(x, st.top_k, st.top_p)
    return torch.where(st.greedy[:, None, None], onehot, x.softmax(-1))


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from (unnormalised) ``probs [b, T, V]`` with uniforms ``u [b, T]`` → ``[b, T]``.

    The chosen index always has positive mass: it is the first index whose CDF exceeds ``u * total``.
    """
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    target = torch.minimum(u.to(cdf.dtype)[..., None] * total, total * (1 - torch.finfo(cdf.dtype).eps))
    idx = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)  # [b, T, 1]
    positive = probs.gather(-1, idx) > 0
    return torch.where(positive, idx, probs.argmax(-1, keepdim=True)).squeeze(-1)


def accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
           u_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance for a whole batch.

    p ``[b, K, V]``: target for positions n+1 … n+K.  q ``[b, K-1, V]``: proposal for n+1 … n+K-1.
    drafts ``[b, K-1]``, u_accept ``[b, K-1]``, u_residual ``[b]``.
    Returns ``L [b]`` (accepted drafts) and the next anchor ``[b]``: drawn from
    ``normalise(max(p_L - q_L, 0))`` after a rejection, or from ``p_{K-1}`` (bonus) when all pass.
    """
    b, k, v = p.shape
    p_d = p[:, : k - 1].gather(-1, drafts[..., None]).squeeze(-1)          # p_{j-1}(d_j) [b, K-1]
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)                       # q_{j-1}(d_j) [b, K-1]
    ok = u_accept.to(p.dtype) * q_d < p_d                                   # u < p/q, no division
    n_acc = ok.long().cumprod(-1).sum(-1)                                   # L [b]
    p_l = p.gather(1, n_acc[:, None, None].expand(b, 1, v)).squeeze(1)      # [b, V]
    q_idx = n_acc.clamp(max=k - 2)[:, None, None].expand(b, 1, v)
    q_l = q.gather(1, q_idx).squeeze(1) * (n_acc < k - 1)[:, None].to(q.dtype)
    residual = (p_l - q_l).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_l)
    nxt = sample(residual[:, None], u_residual[:, None]).squeeze(1)
    return n_acc, nxt


def greedy_accept(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-greedy fast path: the same result as ``accept`` on one-hot distributions, from argmaxes only.

    Returns drafts ``[b, K-1]``, ``L [b]`` and the next anchor ``[b]`` (the AR argmax after the
    accepted prefix: a correction, or the bonus token when every draft matched).
    """
    drafts = q_logits.argmax(-1)                                            # [b, K-1]
    target = p_logits.argmax(-1)                                            # [b, K]
    n_acc = (drafts == target[:, :-1]).long().cumprod(-1).sum(-1)          # [b]
    return drafts, n_acc, target.gather(1, n_acc[:, None]).squeeze(1)
