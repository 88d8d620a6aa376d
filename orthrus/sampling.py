"""Logit processing, inverse-CDF sampling and vectorised speculative acceptance over ``[b, K]``.

Shape legend: b rows, T positions per row, K block size, V vocabulary.

Losslessness rests on two rules (docs/design.md §2.3): the target ``p`` (AR view) and the proposal ``q``
(diffusion view) go through the *same* processing, and every draft is drawn from its own ``q``
independently of the others, so the accept/residual rule below is standard speculative sampling.
Greedy rows use one-hot distributions, for which the same rule reduces to "accept while the draft
equals the AR argmax, then emit the AR argmax".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row processing parameters on the device (gathered for the rows of one forward)."""

    temperature: torch.Tensor  # [b] float; ignored where greedy
    top_k: torch.Tensor        # [b] long; 0 = off
    top_p: torch.Tensor        # [b] float; 1 = off
    greedy: torch.Tensor       # [b] bool
    filtered: bool             # host-known: any row uses top-k or top-p (skips the filter otherwise)
    all_greedy: bool = False   # host-known: every row is greedy (argmax fast path, no probabilities)
    min_p: torch.Tensor | None = None   # [b] float; 0 = off (None: no row uses it, host-known)


@dataclass(frozen=True)
class Penalties:
    """Per-row logit biases and penalties on the device (vLLM's meanings, ``params.SamplingParams``).

    ``bias_ids``/``bias_values`` ``[b, S]`` (ids -1 padded; None: no row has a bias); ``counts [b, V]``
    each token's occurrences among the generated tokens and ``seen [b, V]`` the prompt's tokens (None:
    no row has a penalty); ``repetition [b]`` (1 = off), ``presence [b]``, ``frequency [b]`` (0 = off).
    """

    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    counts: torch.Tensor | None
    seen: torch.Tensor | None
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


# Top-k and top-p keep, in every row, the tokens before a cut in the order (logit descending, token id
# ascending): ties with the k-th logit stay, then tokens stay while the probability strictly before
# them is < top_p (the top token always). Ordering the whole vocabulary for that was most of a sampled
# call at V = 151,936. Here the top CANDIDATES logits (``topk``: one pass over V) fix the cut in most
# rows; the rows they leave open (a nucleus reaching past them, top_k > CANDIDATES, ties at their
# edge) are sorted, with no host read choosing them: every other row is replaced by a constant first,
# and a constant row sorts ~4x faster than logits on the CPU. (A GPU sort costs the same either way,
# so there the full sort stays.) The result is the full stable sort's, exactly; top_p = 1 keeps every
# token (as transformers does; the old float32 cumsum could reach 1.0 early and drop the tail).
CANDIDATES = 256


def _by_logit_then_id(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``[b, T, c]`` in the order a stable sort of the row gives them (``topk`` leaves the
    order of equal logits unspecified, and which of them the top-p cut keeps depends on it)."""
    order = ids.argsort(dim=-1)
    vals, ids = vals.gather(-1, order), ids.gather(-1, order)
    order = vals.argsort(dim=-1, descending=True, stable=True)
    return vals.gather(-1, order), ids.gather(-1, order)


class _Cut(NamedTuple):
    """Where top-k / top-p cut a row, ``[b, T, 1]`` each: keep logits > ``value`` and the first
    ``n_tie`` of those == ``value`` in id order (``n_in`` tokens in all)."""

    value: torch.Tensor
    n_in: torch.Tensor
    n_tie: torch.Tensor
    decided: torch.Tensor | None      # whether the tokens it was found from fix it (None: the whole row)


def _cut(vals: torch.Tensor, mass: torch.Tensor, total: torch.Tensor, k: torch.Tensor, has_k: torch.Tensor,
         p: torch.Tensor, complete: bool) -> _Cut:
    """The cut, from a row's first c tokens by logit: ``vals``/``mass`` ``[b, T, c]`` (descending) are
    their logits and unnormalised probabilities, ``total [b, T, 1]`` the row's whole mass,
    ``k``/``has_k``/``p`` ``[b, 1, 1]``; ``complete``: the c tokens are the whole row."""
    c, ascending = vals.shape[-1], vals.neg()                                 # ``searchsorted`` wants ascending
    kth = vals.gather(-1, (k.clamp(max=c) - 1).expand(*vals.shape[:-1], 1))   # the k-th logit if k <= c
    n_k = torch.searchsorted(ascending, kth.neg(), right=True)                # top-k keeps ties with it
    cum = mass.cumsum(-1)                                                     # mass up to each token
    z = torch.where(has_k, cum.gather(-1, n_k - 1), total)                    # what top-p renormalises by
    # a token stays while the mass strictly before it (the previous prefix sum) is < p·z: the first
    # token, then a prefix, whose length ``searchsorted`` counts
    n_in = torch.minimum(torch.searchsorted(cum, p * z) + 1, n_k)             # >= 1
    nucleus = p < 1
    no_cut = torch.where(has_k, kth, torch.full_like(kth, float("-inf")))
    value = torch.where(nucleus, vals.gather(-1, n_in - 1), no_cut)
    every_tie = torch.full_like(n_in, torch.iinfo(n_in.dtype).max)
    n_tie = torch.where(nucleus, n_in - torch.searchsorted(ascending, value.neg()), every_tie)
    if complete:
        return _Cut(value, n_in, n_tie, None)
    floor = vals[..., -1:]                    # the c-th logit: tokens equal to it may lie outside the c
    k_known = ~has_k | (k <= c)
    p_known = ~nucleus | ((value > floor) & (~has_k | (kth > floor)))     # whole tie groups, exact z
    return _Cut(value, n_in, n_tie, k_known & p_known)


def _cut_by_sort(x: torch.Tensor, top: torch.Tensor, total: torch.Tensor, k: torch.Tensor,
                 has_k: torch.Tensor, p: torch.Tensor, decided: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` and ``last`` (see ``_filtered_probs``) for the rows the candidates left open
    (``decided [b, T, 1]`` False), by sorting them; the decided ones sort as a constant, and their
    result is discarded by the caller. An unstable sort gives the right logits in order; which tied
    tokens stay is then read off the row itself, in id order."""
    vals = x.masked_fill(decided, 0.0).sort(dim=-1, descending=True).values           # [b, T, V]
    cut = _cut(vals, (vals - top).exp_(), total, k, has_k, p, complete=True)
    ties_so_far = (x == cut.value).cumsum(-1, dtype=torch.int32)                      # [b, T, V]
    n_tie = cut.n_tie.clamp(max=x.shape[-1] + 1).to(torch.int32)
    return cut.value, torch.searchsorted(ties_so_far, n_tie)              # the n_tie-th tie's id (or V)


def _find_cut(x: torch.Tensor, mass: torch.Tensor, top: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``value`` and ``last`` ``[b, T, 1]`` (see ``_filtered_probs``) of tempered logits
    ``x [b, T, V]``, whose unnormalised probabilities are ``mass`` and maximum ``top``."""
    v = x.shape[-1]
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)[:, None, None]        # [b, 1, 1]; V = off
    has_k, p = k < v, top_p.to(x.dtype)[:, None, None]
    total = mass.sum(-1, keepdim=True)
    c = min(v, CANDIDATES)
    if c == v or x.device.type != "cpu":   # a small vocabulary, or a GPU: a constant row sorts no faster
        vals, ids = x.sort(dim=-1, descending=True, stable=True)
    else:
        vals, ids = _by_logit_then_id(*x.topk(c, dim=-1))                   # [b, T, c]
    cut = _cut(vals, mass.gather(-1, ids), total, k, has_k, p, complete=vals.shape[-1] == v)
    # in (logit, id) order the n_in-th token is the last tie that stays
    last = torch.where(p < 1, ids.gather(-1, cut.n_in - 1), torch.full_like(cut.n_in, v))
    if cut.decided is None:
        return cut.value, last
    sorted_value, sorted_last = _cut_by_sort(x, top, total, k, has_k, p, cut.decided)
    return torch.where(cut.decided, cut.value, sorted_value), torch.where(cut.decided, last, sorted_last)


def _filtered_probs(x: torch.Tensor, top: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p then softmax of tempered logits ``x [b, T, V]`` (row maxima ``top [b, T, 1]``):
    each row keeps the logits above its cut's ``value``, and those equal to it up to token id ``last``."""
    mass = (x - top).exp_()                                                   # the top token's is 1
    value, last = _find_cut(x, mass, top, top_k, top_p)
    ids = torch.arange(x.shape[-1], device=x.device)
    mass.mul_((x > value) | ((x == value) & (ids <= last)))
    return mass.div_(mass.sum(-1, keepdim=True))


def process(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logits ``[b, T, V]`` → probabilities ``[b, T, V]``: temperature, top-k, top-p, softmax."""
    x = logits.to(_work_dtype(logits))
    if st.all_greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature).to(x.dtype)
    x = x / temp[:, None, None]
    top, first = x.max(-1, keepdim=True)             # greedy rows are untempered: ``first`` is their argmax
    if st.min_p is not None:
        # p < min_p * p_top  <=>  x - top < log(min_p); min_p = 0 keeps every token (log 0 = -inf)
        floor = top + st.min_p.to(x.dtype).log()[:, None, None]
        x = x.masked_fill(x < floor, float("-inf"))
    probs = _filtered_probs(x, top, st.top_k, st.top_p) if st.filtered else x.softmax(-1)
    greedy = st.greedy[:, None, None]
    probs.masked_fill_(greedy, 0.0)                   # a fill, not a product: NaN-safe for extreme logits
    return probs.scatter_(-1, first, torch.where(greedy, 1.0, probs.gather(-1, first)))


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


class Verdict(NamedTuple):
    """The verifier's verdict on a block: the drafts ``[b, K-1]``, how many were accepted ``L [b]``,
    and the next anchor ``[b]`` (the correction after a rejection, or the bonus token)."""

    drafts: torch.Tensor
    n_acc: torch.Tensor
    next_token: torch.Tensor


def accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
           u_residual: torch.Tensor, width: torch.Tensor | None = None) -> Verdict:
    """Speculative acceptance for a whole batch.

    p ``[b, K, V]``: target for positions n+1 … n+K.  q ``[b, K-1, V]``: proposal for n+1 … n+K-1.
    drafts ``[b, K-1]``, u_accept ``[b, K-1]``, u_residual ``[b]``; ``width [b]``: the drafts each
    row verified (a prefix; None: all K-1), its target valid at positions 0 … width.
    The next anchor is drawn from ``normalise(max(p_L - q_L, 0))`` after a rejection, or from
    ``p_width`` (bonus) when every verified draft passes: standard speculative sampling on the
    shorter block, exact as long as the width does not depend on the drafts drawn.
    """
    b, k, v = p.shape
    p_d = p[:, : k - 1].gather(-1, drafts[..., None]).squeeze(-1)          # p_{j-1}(d_j) [b, K-1]
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)                       # q_{j-1}(d_j) [b, K-1]
    ok = u_accept.to(p.dtype) * q_d < p_d                                   # u < p/q, no division
    if width is not None:
        ok &= torch.arange(k - 1, device=p.device)[None, :] < width[:, None]   # unverified: not accepted
    n_acc = ok.long().cumprod(-1).sum(-1)                                   # L [b]
    p_l = p.gather(1, n_acc[:, None, None].expand(b, 1, v)).squeeze(1)      # [b, V]
    q_idx = n_acc.clamp(max=k - 2)[:, None, None].expand(b, 1, v)
    rejected = n_acc < (k - 1 if width is None else width)                  # else the bonus, from p_L alone
    q_l = q.gather(1, q_idx).squeeze(1) * rejected[:, None].to(q.dtype)
    residual = (p_l - q_l).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_l)
    nxt = sample(residual[:, None], u_residual[:, None]).squeeze(1)
    return Verdict(drafts, n_acc, nxt)


def greedy_accept(p_logits: torch.Tensor, q_logits: torch.Tensor, width: torch.Tensor | None = None) -> Verdict:
    """All-greedy fast path: the same result as ``accept`` on one-hot distributions, from argmaxes
    only (the next anchor is the AR argmax after the accepted prefix; ``width`` as in ``accept``)."""
    drafts = q_logits.argmax(-1)                                            # [b, K-1]
    target = p_logits.argmax(-1)                                            # [b, K]
    n_acc = (drafts == target[:, :-1]).long().cumprod(-1).sum(-1)          # [b]
    if width is not None:
        n_acc = torch.minimum(n_acc, width)
    return Verdict(drafts, n_acc, target.gather(1, n_acc[:, None]).squeeze(1))


def _penalised(logits: torch.Tensor, count: torch.Tensor, seen: torch.Tensor, pen: Penalties,
               idx: tuple[slice | None, ...]) -> torch.Tensor:
    """The penalty rule, elementwise: ``logits`` of tokens occurring ``count`` times among the
    generated tokens (``seen``: in the prompt or generated); the rows' penalties broadcast by ``idx``."""
    rep = pen.repetition.to(logits.dtype)[idx]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    x = torch.where(seen | (count > 0), repeated, logits)
    c = count.to(logits.dtype)
    return x - pen.frequency.to(logits.dtype)[idx] * c - pen.presence.to(logits.dtype)[idx] * (c > 0).to(logits.dtype)


def apply_penalties(logits: torch.Tensor, pen: Penalties, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [b, T, V]`` with the rows' logit biases added, then their repetition, frequency and
    presence penalties applied with each position's token counts: position t follows ``drafts [b,
    T-1]``'s first t (the verify inputs after the anchor; None: no drafts, one count for every
    position), so each target is what plain AR decoding computes after those drafts. A copy."""
    x = logits
    if pen.bias_ids is not None:
        ids = pen.bias_ids.clamp(min=0)[:, None, :].expand(-1, x.shape[1], -1)          # [b, T, S]; pad adds 0
        add = torch.where(pen.bias_ids >= 0, pen.bias_values, 0.0).to(x.dtype)[:, None, :].expand_as(ids)
        x = x.scatter_add(-1, ids, add)
    if pen.counts is None:
        return x
    row = (slice(None), None, None)
    base = _penalised(x, pen.counts[:, None, :], pen.seen[:, None, :], pen, row)       # [b, T, V]
    if drafts is None or x.shape[1] < 2:
        return base
    # Position t counts the drafts d_1..d_t too: rewrite each draft token's logit at every position
    # with its count there (the other tokens' counts are the base ones). A token drafted twice gets
    # the same value from both of its entries, so the scatter's order does not matter.
    b, t = x.shape[:2]
    same = drafts[:, None, :] == drafts[:, :, None]                                     # [b, T-1 (j), T-1 (i)]
    before = torch.arange(1, t, device=x.device)[None, :] <= torch.arange(t, device=x.device)[:, None]  # [T, T-1]: d_i by t
    extra = (same[:, None, :, :] & before[None, :, None, :]).sum(-1)                    # [b, T, T-1]
    ids = drafts[:, None, :].expand(b, t, -1)                                           # [b, T, T-1]
    count = pen.counts.gather(-1, drafts)[:, None, :] + extra
    seen = pen.seen.gather(-1, drafts)[:, None, :].expand(b, t, -1)
    vals = _penalised(x.gather(-1, ids), count, seen, pen, (slice(None), None, None))
    return base.scatter(-1, ids, vals)


def forbid_early_stops(logits: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                       min_new: torch.Tensor) -> torch.Tensor:
    """``logits [b, T, V]`` with every stop id ``stop_ids [b, S]`` (-1 padded, ascending) set to -inf
    at the positions whose token would be generated before ``min_new [b]`` (position t holds token
    ``produced + t``, ``produced [b]`` already generated): vLLM's ``min_tokens``, applied to the
    target only, so a draft that is such a stop has probability 0 and is rejected (exact). A copy."""
    t = torch.arange(logits.shape[1], device=logits.device)
    early = (produced[:, None] + t[None, :] < min_new[:, None]) & (stop_ids[:, :1] >= 0)    # [b, T]
    # Padding (-1) repeats the row's first stop id, so duplicate indices always write the same value.
    ids = torch.where(stop_ids >= 0, stop_ids, stop_ids[:, :1]).clamp(min=0)            # [b, S]
    idx = ids[:, None, :].expand(-1, logits.shape[1], -1)                                 # [b, T, S]
    vals = torch.where(early[..., None], float("-inf"), logits.gather(-1, idx))
    return logits.scatter(-1, idx, vals)


def force_reasoning_end(logits: torch.Tensor, drafts: torch.Tensor | None, produced: torch.Tensor,
                        think_at: torch.Tensor, span: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """``logits [b, T, V]`` with a spent thinking budget's tokens forced: position t holds token
    ``produced [b] + t``; where that is ``think_at [b] + i`` (-1: no budget pending) for ``i`` below
    ``span [b]`` (at most ``len(forced [m])``: the think end, then the separator), only ``forced[i]`` is allowed, unless a
    think end came earlier among ``drafts [b, T-1]`` (the verify inputs after the anchor; None for one
    position). The target becomes one token there, so any other draft is rejected (exact). A copy."""
    b, t = logits.shape[:2]
    pos = produced[:, None] + torch.arange(t, device=logits.device)[None, :]          # [b, T]
    offset = pos - think_at[:, None]
    pending = (think_at[:, None] >= 0) & (offset >= 0) & (offset < span[:, None])
    if drafts is not None and t > 1:
        # A think end drafted before the budget closes the phase for the positions after it.
        early = (drafts == forced[0]) & (pos[:, : t - 1] < think_at[:, None])         # [b, T-1]
        closed = torch.cat([torch.zeros_like(early[:, :1]), early.cumsum(1) > 0], 1)  # [b, T]
        pending = pending & ~closed
    token = forced[offset.clamp(0, forced.shape[0] - 1)]                              # [b, T]
    only = torch.full_like(logits, float("-inf")).scatter(-1, token[..., None], 0.0)
    return torch.where(pending[..., None], only, logits)
