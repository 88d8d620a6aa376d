"""Device side of decoding: per-slot state and the prefill / speculative-cycle / AR-step kernels.

Everything here is batched tensor code over the rows of one forward (``b`` of the ``B`` slots);
nothing reads a value back to the host. Each function works on a :class:`ModelRunner`'s model,
cache, backend and state, shaped by an ``IterationPlan``; the runner does one transfer per
iteration of the packed result these functions return (its layout: ``packed.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from orthrus import rng
from orthrus.engine import logprobs
from orthrus.engine.grammar import IterationMasks, constrain
from orthrus.model.backends import BlockBatch
from orthrus.model.cache import RaggedKVCache
from orthrus.engine.packed import pack
from orthrus.engine.prefill import PrefillBatch, prompt_states
from orthrus.engine.requests import FinishReason
from orthrus.params import MAX_LOGPROBS
from orthrus.sampling import SamplingTensors, accept, greedy_accept, process, sample

if TYPE_CHECKING:   # the runner owns what these functions work on, and calls them
    from orthrus.engine.runner import IterationPlan, ModelRunner

RUNNING, STOP, LENGTH = int(FinishReason.RUNNING), int(FinishReason.STOP), int(FinishReason.LENGTH)


class SlotState:
    """Per-slot decoding state on the device, ``[B]`` (``stop_ids [B, S]``, padded with -1)."""

    def __init__(self, num_slots: int, stop_width: int, device: torch.device, hidden_size: int = 1,
                 dtype: torch.dtype = torch.float32) -> None:
        # Allocated once per engine: captured CUDA graphs hold these addresses (graphs.py).
        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_slots, dtype=dtype, device=device)
        self.anchor, self.seed, self.counter, self.row = z(torch.long), z(torch.long), z(torch.long), z(torch.long)
        self.out_count, self.max_new, self.prompt_len = z(torch.long), z(torch.long), z(torch.long)
        self.reason, self.first = z(torch.long), z(torch.long) - 1
        self.top_k, self.temperature, self.top_p = z(torch.long), z(torch.float64), z(torch.float64) + 1
        self.greedy, self.alive = z(torch.bool), z(torch.bool)
        self.stop_ids = torch.full((num_slots, max(stop_width, 1)), -1, dtype=torch.long, device=device)
        # [B, E] the final hidden state at the prompt's last position: with the prompt's K/V (cache
        # positions < prompt_len, never overwritten while the row runs) it lets a later request with
        # the same prompt start from this slot's prefill instead of computing its own.
        self.prompt_hidden = torch.zeros((num_slots, hidden_size), dtype=dtype, device=device)
        # The first token's logprobs, from the prefill's logits, until the row's first iteration packs them.
        self.first_lp = z(torch.float64)
        self.first_top_lp = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.float64, device=device)
        self.first_top_id = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.long, device=device)

    def widen(self, stop_width: int) -> None:
        """Room for ``stop_width`` stop ids per slot, keeping every slot's current ones."""
        old = self.stop_ids
        if stop_width <= old.shape[1]:
            return
        self.stop_ids = torch.full((old.shape[0], stop_width), -1, dtype=torch.long, device=old.device)
        self.stop_ids[:, : old.shape[1]] = old

    def reset(self) -> None:
        """Every slot empty and dead, in place (a prefill sets all of a slot's fields)."""
        for t in (self.anchor, self.seed, self.counter, self.row, self.out_count, self.max_new,
                  self.prompt_len, self.reason, self.top_k, self.temperature, self.greedy, self.alive):
            t.zero_()
        self.first.fill_(-1)
        self.top_p.fill_(1)
        self.stop_ids.fill_(-1)

    def sampling(self, slots: torch.Tensor, filtered: bool, all_greedy: bool) -> SamplingTensors:
        """Processing parameters of the given slots (the flags are host-known, never read back)."""
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots],
                               self.greedy[slots], filtered, all_greedy)


def stop_cut(emitted: torch.Tensor, n_acc: torch.Tensor, st: SlotState, slots: torch.Tensor,
             max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate each row's emitted tokens ``[b, W]`` (valid up to index L) at its first stop.

    Returns ``n_emit [b]`` and ``reason [b]``: a stop token (kept), ``max_new_tokens`` or the
    context limit ends the row; tokens after it in the accepted block are discarded.
    """
    i = torch.arange(emitted.shape[1], device=emitted.device)[None, :]
    valid = i <= n_acc[:, None]                                               # [b, W]
    produced = st.out_count[slots][:, None] + i + 1                           # tokens generated so far
    is_stop = (emitted[..., None] == st.stop_ids[slots][:, None, :]).any(-1) & valid
    too_long = (produced >= st.max_new[slots][:, None]) | (st.prompt_len[slots][:, None] + produced >= max_seq_len)
    end = is_stop | (too_long & valid)
    has_end = end.any(-1)
    first_end = torch.where(has_end, end.long().argmax(-1), n_acc)           # argmax = first True
    stopped = is_stop.gather(1, first_end[:, None]).squeeze(1)
    reason = torch.where(has_end, torch.where(stopped, STOP, LENGTH), RUNNING)
    return first_end + 1, reason


def prefill(run: ModelRunner, pb: PrefillBatch, filtered: bool, all_greedy: bool, lp_width: int | None) -> None:
    """Prefill the admitted slots (each prompt prefix at most once) and sample every row's first
    anchor from its own seed; with ``lp_width`` (a top-k width, host-known), keep its logprobs too."""
    model, cache, st, max_seq_len = run.model, run.cache, run.state, run.max_seq_len
    prompt_states(model, cache, run.backend, st.prompt_hidden, pb.stages)
    slots, row_lens = pb.slots, pb.row_lens
    logits = model.logits(st.prompt_hidden[slots])[:, None]                 # [b, 1, V]
    masked = logits if pb.masks is None else constrain(logits, pb.masks[:, None])
    probs = process(masked, st.sampling(slots, filtered, all_greedy))
    u_first = rng.uniforms(st.seed[slots], torch.zeros_like(row_lens), rng.STREAM_FIRST, 1)
    first = sample(probs, u_first)[:, 0]                                     # [b]
    if lp_width is not None:
        logprobs.store_first(st, slots, logits, first, lp_width)
    cache.lengths[slots] = row_lens
    st.prompt_len[slots] = row_lens
    st.out_count.index_fill_(0, slots, 0)   # index_fill_: a scalar as a kernel argument (syncs.py)
    st.counter.index_fill_(0, slots, 0)
    n_emit, reason = stop_cut(first[:, None], torch.zeros_like(row_lens), st, slots, max_seq_len)
    st.out_count[slots] = n_emit
    st.anchor[slots] = first
    st.first[slots] = first
    st.reason[slots] = reason
    st.alive[slots] = reason == RUNNING


def _write_offsets(cache: RaggedKVCache, st: SlotState, slots: torch.Tensor) -> torch.Tensor:
    """Where each row's block goes: its committed length, or 0 for a dead row.

    A row that ended near the context limit keeps a length up to ``max_seq_len - 2 + K``; run again
    as padding of a static batch (``graphs.py``), a block written there would pass the slot's
    capacity (and, through flash's strided view, land in the next head or slot). Dead rows write
    into the start of their own slot instead, which nobody reads until a prefill overwrites it.
    """
    return cache.lengths[slots] * st.alive[slots]


def _commit(st: SlotState, cache: RaggedKVCache, slots: torch.Tensor, emitted: torch.Tensor,
            n_acc: torch.Tensor, nxt: torch.Tensor, max_seq_len: int, lp_block: torch.Tensor | None) -> torch.Tensor:
    """Apply one cycle's outcome to live rows (crop = length update) and pack it for the host, with
    the iteration's logprob block (``logprobs.block``, computed before the commit) if there is one."""
    alive = st.alive[slots]
    n_emit, reason = stop_cut(emitted, n_acc, st, slots, max_seq_len)
    n_emit = n_emit * alive
    cache.lengths[slots] += (n_acc + 1) * alive
    st.out_count[slots] += n_emit
    st.counter[slots] += alive.long()
    st.anchor[slots] = torch.where(alive, nxt, st.anchor[slots])
    new_reason = torch.where(alive, reason, st.reason[slots])
    st.reason[slots] = new_reason
    st.alive[slots] = alive & (new_reason == RUNNING)
    first = st.first[slots]
    st.first.index_fill_(0, slots, -1)
    packed = pack(emitted, n_emit, n_acc * alive, new_reason, alive, first)  # [b, W + 5]
    return packed if lp_block is None else torch.cat([packed, lp_block], 1)


def speculative_cycle(run: ModelRunner, plan: IterationPlan, slots: torch.Tensor,
                      masks: IterationMasks | None = None) -> torch.Tensor:
    """Draft (diffusion view) → verify (AR view) → accept → commit, for the rows in ``slots``; with
    ``plan.logprobs`` (a top-k width), every emitted token's logprobs from the verify forward's raw logits.

    With grammar ``masks``, the target at each verify position is the AR distribution restricted to
    the tokens the grammar allows after the drafts before it: a draft it refuses has probability 0
    and is rejected. The first draft comes from the masked proposal (its mask is known up front), the
    others from the unmasked one, and acceptance and residual use exactly those proposals.
    """
    model, cache, backend, st, k = run.model, run.cache, run.backend, run.state, plan.block
    n = _write_offsets(cache, st, slots)                                      # [b]
    pos = n[:, None] + torch.arange(k, device=n.device)[None, :]             # [b, K]
    view_slots = None if plan.all_slots else slots
    draft_view = BlockBatch(view_slots, pos, plan.kv_len, causal=False)
    sp = st.sampling(slots, plan.filtered, plan.all_greedy)
    seed, counter, anchor = st.seed[slots], st.counter[slots] + 1, st.anchor[slots]
    q_logits = run.proposer.propose(anchor, draft_view, cache, st.row[slots], backend)   # [b, K-1, V]
    if masks is not None:
        q_logits = torch.cat([constrain(q_logits[:, :1], masks.first[:, None]), q_logits[:, 1:]], 1)
    verify_view = BlockBatch(view_slots, pos, plan.kv_len)
    if plan.all_greedy:
        drafts = q_logits.argmax(-1)                                                # [b, K-1]
        if masks is not None:
            masks.start(drafts)
        p_logits = model.logits(model.forward_cached(torch.cat([anchor[:, None], drafts], 1), cache,
                                                     verify_view, diffusion=False, backend=backend))
        target = p_logits if masks is None else constrain(p_logits, masks.along())
        drafts, n_acc, nxt = greedy_accept(target, q_logits)
    else:
        q = process(q_logits, sp)
        drafts = sample(q, rng.uniforms(seed, counter, rng.STREAM_DRAFT, k - 1))    # [b, K-1]
        if masks is not None:
            masks.start(drafts)
        block = torch.cat([anchor[:, None], drafts], 1)                             # [b, K]
        hidden = model.forward_cached(block, cache, verify_view, diffusion=False, backend=backend)
        p_logits = model.logits(hidden)                                             # [b, K, V]
        p = process(p_logits if masks is None else constrain(p_logits, masks.along()), sp)
        n_acc, nxt = accept(p, q, drafts, rng.uniforms(seed, counter, rng.STREAM_ACCEPT, k - 1),
                            rng.uniforms(seed, counter, rng.STREAM_RESIDUAL, 1)[:, 0])
    i = torch.arange(k, device=n.device)[None, :]
    emitted = torch.where(i < n_acc[:, None], torch.cat([drafts, nxt[:, None]], 1), nxt[:, None])
    lp = None if plan.logprobs is None else logprobs.block(st, slots, p_logits, emitted, plan.logprobs)
    return _commit(st, cache, slots, emitted, n_acc, nxt, run.max_seq_len, lp)


def ar_step(run: ModelRunner, plan: IterationPlan, slots: torch.Tensor,
            masks: IterationMasks | None = None) -> torch.Tensor:
    """One plain AR step (our baseline) on the same cache and bookkeeping (logprobs as in a cycle);
    with grammar ``masks``, from the distribution restricted to what each row's grammar allows."""
    model, cache, st = run.model, run.cache, run.state
    n = _write_offsets(cache, st, slots)
    pos = n[:, None]                                                          # [b, 1]
    view = BlockBatch(None if plan.all_slots else slots, pos, plan.kv_len)
    hidden = model.forward_cached(st.anchor[slots][:, None], cache, view, diffusion=False, backend=run.backend)
    logits = model.logits(hidden)                                            # [b, 1, V]
    masked = logits if masks is None else constrain(logits, masks.first[:, None])
    if plan.all_greedy:
        nxt = masked[:, 0].argmax(-1)
    else:
        p = process(masked, st.sampling(slots, plan.filtered, plan.all_greedy))
        nxt = sample(p, rng.uniforms(st.seed[slots], st.counter[slots] + 1, rng.STREAM_AR, 1))[:, 0]
    lp = None if plan.logprobs is None else logprobs.block(st, slots, logits, nxt[:, None], plan.logprobs)
    return _commit(st, cache, slots, nxt[:, None], torch.zeros_like(n), nxt, run.max_seq_len, lp)


def settle(run: ModelRunner, slots: torch.Tensor, width: int, lp_width: int | None) -> torch.Tensor:
    """Pack rows that were complete after their prefill (they take no part in the iteration) in the
    iteration's layout: their first token, reason and, with ``lp_width``, its logprobs; nothing else."""
    st = run.state
    none = torch.zeros((slots.shape[0], width), dtype=torch.long, device=slots.device)   # [d, W]
    zero = none[:, 0]
    first = st.first[slots]
    st.first.index_fill_(0, slots, -1)
    packed = pack(none, zero, zero, st.reason[slots], zero.bool(), first)               # [d, W + 5]
    return packed if lp_width is None else torch.cat([packed, logprobs.first_block(st, slots, width, lp_width)], 1)
