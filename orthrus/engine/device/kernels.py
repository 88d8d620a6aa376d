"""Device side of decoding: the prefill, speculative-cycle, AR-step and settle kernels.

Everything here is batched tensor code over the rows of one forward (``b`` of the ``B`` slots);
nothing reads a value back to the host. Each function works on the engine's :class:`DeviceParts`,
shaped by an :class:`IterationPlan`; the runner does one transfer per iteration of the packed result
these functions return (its layout: ``packed.py``).
"""
from __future__ import annotations

import torch

from orthrus import rng
from orthrus.engine.device import logprobs
from orthrus.engine.device.masks import IterationMasks, constrain
from orthrus.engine.device.plan import DeviceParts, IterationPlan
from orthrus.engine.device.prefill import ChunkForward, ar_forward
from orthrus.engine.device.slot_state import SlotState
from orthrus.engine.device.verify_budget import VerifyLayout, confidences, widths
from orthrus.engine.outputs import FinishReason
from orthrus.engine.step import SamplingPaths
from orthrus.model.backends import BlockBatch
from orthrus.model.cache import PagedKVCache
from orthrus.ranges import named_range
from orthrus.sampling import (Penalties, accept, apply_penalties, forbid_early_stops, force_reasoning_end,
                              greedy_accept, process, sample)

RUNNING, STOP, LENGTH = int(FinishReason.RUNNING), int(FinishReason.STOP), int(FinishReason.LENGTH)


def pack(emitted: torch.Tensor, n_emit: torch.Tensor, n_acc: torch.Tensor, reason: torch.Tensor,
         alive: torch.Tensor, first: torch.Tensor, n_ver: torch.Tensor) -> torch.Tensor:
    """``emitted [b, W]`` and six ``[b]`` columns, in ``packed.COLUMNS`` order (a test holds the
    parameter names to it) → ``[b, W + 6]`` int64."""
    return torch.cat([emitted, torch.stack([n_emit, n_acc, reason, alive.long(), first, n_ver], 1)], 1)


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


def _target(logits: torch.Tensor, st: SlotState, slots: torch.Tensor, paths: SamplingPaths,
            produced: torch.Tensor, pen: Penalties | None, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """The AR logits ``[b, T, V]`` the target distribution comes from: logit biases and penalties
    (``pen``, the rows' ``SlotState.penalties``, gathered once per iteration; with each position's
    token counts), stop ids forbidden where a row has generated fewer than its ``min_tokens``, and a
    spent thinking budget's tokens forced (each only when some row may, host-known).
    ``drafts [b, T-1]``: the verify inputs after the anchor."""
    if pen is not None:
        logits = apply_penalties(logits, pen, drafts)
    if paths.min_tokens:
        logits = forbid_early_stops(logits, st.stop_ids[slots], produced, st.min_new[slots])
    if paths.thinking:
        logits = force_reasoning_end(logits, drafts, produced, st.think_at[slots], st.think_span[slots],
                                     st.forced_thinking)
    return logits


def _close_thinking(st: SlotState, slots: torch.Tensor, emitted: torch.Tensor, n_emit: torch.Tensor,
                    produced: torch.Tensor) -> None:
    """A think end committed before a row's budget position ends its phase: nothing is forced after
    it. ``emitted [b, W]`` (the first ``n_emit`` kept) hold tokens ``produced [b]`` onwards."""
    i = torch.arange(emitted.shape[1], device=emitted.device)[None, :]
    think_at = st.think_at[slots]
    early = (emitted == st.forced_thinking[0]) & (i < n_emit[:, None]) & (produced[:, None] + i < think_at[:, None])
    st.think_at[slots] = torch.where(early.any(-1), -1, think_at)


def _count(st: SlotState, slots: torch.Tensor, tokens: torch.Tensor, n_keep: torch.Tensor,
           paths: SamplingPaths) -> None:
    """Add the first ``n_keep [b]`` of ``tokens [b, W]`` to the rows' token counts (penalties), when
    some row has a penalty (the other rows' counts are never read: they restart at their seat)."""
    if paths.penalties:
        keep = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < n_keep[:, None]
        st.counts.index_put_((slots[:, None].expand_as(tokens), tokens), keep.to(st.counts.dtype), accumulate=True)


@named_range("prefill")
def prefill_chunks(dev: DeviceParts, chunk: ChunkForward) -> None:
    """A step's prompt chunks in a forward of their own (a step without an iteration)."""
    ar_forward(dev.model, dev.cache, dev.backend, dev.state.prompt_hidden, None, None, chunk)


@named_range("prefill")
def sample_first(dev: DeviceParts, slots: torch.Tensor, row_lens: torch.Tensor, masks: torch.Tensor | None,
                 paths: SamplingPaths, lp_width: int | None) -> None:
    """Rows ``slots [d]`` whose prompts (``row_lens [d]``) are complete: sample each one's first
    anchor from its prompt's last hidden state with its own seed (grammar ``masks [d, W]`` or None);
    with ``lp_width`` (a top-k width, host-known), keep its logprobs too."""
    cache, st = dev.cache, dev.state
    logits = dev.model.logits(st.prompt_hidden[slots])[:, None]               # [d, 1, V]
    masked = logits if masks is None else constrain(logits, masks[:, None])
    probs = process(_target(masked, st, slots, paths, torch.zeros_like(row_lens), st.penalties(slots, paths)),
                    st.sampling(slots, paths))
    u_first = rng.uniforms(st.seed[slots], torch.zeros_like(row_lens), rng.STREAM_FIRST, 1)
    first = sample(probs, u_first)[:, 0]                                     # [d]
    if lp_width is not None:
        logprobs.store_first(st, slots, logits, first, lp_width)
    cache.lengths[slots] = row_lens
    st.prompt_len[slots] = row_lens
    st.out_count.index_fill_(0, slots, 0)   # index_fill_: a scalar as a kernel argument (testing/host_syncs.py)
    st.counter.index_fill_(0, slots, 0)
    n_emit, reason = stop_cut(first[:, None], torch.zeros_like(row_lens), st, slots, dev.max_seq_len)
    if paths.thinking:
        _close_thinking(st, slots, first[:, None], n_emit, torch.zeros_like(row_lens))
    st.out_count[slots] = n_emit
    _count(st, slots, first[:, None], n_emit, paths)
    st.anchor[slots] = first
    st.first[slots] = first
    st.reason[slots] = reason
    st.alive[slots] = reason == RUNNING
    cache.drop_dead(slots, st.alive[slots])


def _write_offsets(cache: PagedKVCache, st: SlotState, slots: torch.Tensor) -> torch.Tensor:
    """Where each row's block goes: its committed length, or 0 for a dead row.

    A row that ended near the context limit keeps a length up to ``max_seq_len - 2 + K``; run again
    as padding of a static batch (``graphs.py``), a block written there would pass its page table.
    Dead rows write at position 0 instead, which their table points at the null page
    (``cache.drop_dead``; a free slot's table is all null): nobody reads it.
    """
    return cache.lengths[slots] * st.alive[slots]


def _commit(dev: DeviceParts, slots: torch.Tensor, emitted: torch.Tensor, n_acc: torch.Tensor, nxt: torch.Tensor,
            lp_block: torch.Tensor | None, paths: SamplingPaths, n_ver: torch.Tensor) -> torch.Tensor:
    """Apply one cycle's outcome to live rows (crop = length update) and pack it for the host, with
    the drafts each row verified (``n_ver [b]``) and the iteration's logprob block
    (``logprobs.block``, computed before the commit) if there is one."""
    st, cache = dev.state, dev.cache
    alive = st.alive[slots]
    n_emit, reason = stop_cut(emitted, n_acc, st, slots, dev.max_seq_len)
    n_emit = n_emit * alive
    if paths.thinking:
        _close_thinking(st, slots, emitted, n_emit, st.out_count[slots])
    cache.lengths[slots] += (n_acc + 1) * alive
    st.out_count[slots] += n_emit
    _count(st, slots, emitted, n_emit, paths)
    st.counter[slots] += alive.long()
    st.anchor[slots] = torch.where(alive, nxt, st.anchor[slots])
    new_reason = torch.where(alive, reason, st.reason[slots])
    st.reason[slots] = new_reason
    st.alive[slots] = alive & (new_reason == RUNNING)
    cache.drop_dead(slots, st.alive[slots])
    first = st.first[slots]
    st.first.index_fill_(0, slots, -1)
    packed = pack(emitted, n_emit=n_emit, n_acc=n_acc * alive, reason=new_reason, alive=alive, first=first,
                  n_ver=n_ver * alive)
    return packed if lp_block is None else torch.cat([packed, lp_block], 1)   # [b, W + 6 (+ block)]


def speculative_cycle(dev: DeviceParts, plan: IterationPlan, slots: torch.Tensor,
                      masks: IterationMasks | None = None, chunk: ChunkForward | None = None) -> torch.Tensor:
    """Draft (diffusion view) → verify (AR view) → accept → commit, for the rows in ``slots``; with
    ``plan.logprobs`` (a top-k width), every emitted token's logprobs from the verify forward's raw logits.

    With grammar ``masks``, the target at each verify position is the AR distribution restricted to
    the tokens the grammar allows after the drafts before it: a draft it refuses has probability 0
    and is rejected. The first draft comes from the masked proposal (its mask is known up front), the
    others from the unmasked one, and acceptance and residual use exactly those proposals. A row's
    ``min_tokens`` restricts the target the same way (its stop ids, where it may not stop yet), and a
    spent thinking budget to the one token it forces. A step's prompt ``chunk`` rides in the
    verify forward (``prefill.ar_forward``).
    """
    model, cache, backend, st, k = dev.model, dev.cache, dev.backend, dev.state, plan.block
    n = _write_offsets(cache, st, slots)                                      # [b]
    pos = n[:, None] + torch.arange(k, device=n.device)[None, :]             # [b, K]
    view_slots = None if plan.all_slots else slots
    draft_view = BlockBatch(view_slots, pos, plan.kv_len, causal=False)
    sp = st.sampling(slots, plan.paths)
    seed, counter, anchor = st.seed[slots], st.counter[slots] + 1, st.anchor[slots]
    q_logits = dev.proposer.propose(anchor, draft_view, cache, slots, backend)    # [b, K-1, V]
    pen = st.penalties(slots, plan.paths)
    if pen is not None:       # the proposal with the row's biases and penalties so far: closer to the target
        q_logits = apply_penalties(q_logits, pen)
    if masks is not None:
        q_logits = torch.cat([constrain(q_logits[:, :1], masks.first[:, None]), q_logits[:, 1:]], 1)
    verify_view = BlockBatch(view_slots, pos, plan.kv_len)
    layout = None if plan.verify is None else _verify_layout(dev, plan, slots, q_logits)
    width = None if layout is None else layout.width                         # [b] drafts verified
    # Greedy: the drafter's argmax, no proposal distribution; sampled: drafts from the processed proposal q.
    q = None if plan.paths.all_greedy else process(q_logits, sp)
    drafts = q_logits.argmax(-1) if q is None else sample(q, rng.uniforms(seed, counter, rng.STREAM_DRAFT, k - 1))
    if masks is not None:                                                        # drafts: [b, K-1]
        masks.start(drafts)
    p_logits = _verify(dev, torch.cat([anchor[:, None], drafts], 1), verify_view, chunk, layout)   # [b, K, V]
    target = _target(p_logits if masks is None else constrain(p_logits, masks.along()), st, slots, plan.paths,
                     st.out_count[slots], pen, drafts)
    if q is None:
        verdict = greedy_accept(target, q_logits, width)
    else:
        verdict = accept(process(target, sp), q, drafts, rng.uniforms(seed, counter, rng.STREAM_ACCEPT, k - 1),
                         rng.uniforms(seed, counter, rng.STREAM_RESIDUAL, 1)[:, 0], width)
    drafts, n_acc, nxt = verdict.drafts, verdict.n_acc, verdict.next_token
    i = torch.arange(k, device=n.device)[None, :]
    emitted = torch.where(i < n_acc[:, None], torch.cat([drafts, nxt[:, None]], 1), nxt[:, None])
    lp = None if plan.logprobs is None else logprobs.block(st, slots, p_logits, emitted, plan.logprobs)
    n_ver = torch.full_like(n, k - 1) if width is None else width
    return _commit(dev, slots, emitted, n_acc, nxt, lp, plan.paths, n_ver)


def _verify_layout(dev: DeviceParts, plan: IterationPlan, slots: torch.Tensor, q_logits: torch.Tensor) -> VerifyLayout:
    """Which drafts the cycle verifies: ``plan.verify`` of them, where the drafter is most confident
    (``verify_budget.py``), among the drafts a live row could still emit before its token limit."""
    st, k = dev.state, plan.block
    limit = torch.minimum(st.max_new[slots], dev.max_seq_len - st.prompt_len[slots])
    left = limit - st.out_count[slots]                                        # [b] tokens a row may still emit
    j = torch.arange(k - 1, device=slots.device)[None, :]
    useful = (j <= left[:, None] - 2) & st.alive[slots][:, None]              # [b, K-1]: the last can be the bonus
    return VerifyLayout.of(widths(confidences(q_logits), useful, plan.verify), k, plan.verify)


def _verify(dev: DeviceParts, block: torch.Tensor, view: BlockBatch, chunk: ChunkForward | None,
            layout: VerifyLayout | None) -> torch.Tensor:
    """The verify forward's logits ``[b, K, V]`` for ``block [b, K]`` (with a ``layout``, computed for
    its verified cells only; cells past a row's width repeat its last)."""
    hidden = ar_forward(dev.model, dev.cache, dev.backend, dev.state.prompt_hidden, block, view, chunk, layout)
    logits = dev.model.logits(hidden)                                         # [b, K, V] | [N, V]
    return logits if layout is None else layout.cells(logits)


def ar_step(dev: DeviceParts, plan: IterationPlan, slots: torch.Tensor,
            masks: IterationMasks | None = None, chunk: ChunkForward | None = None) -> torch.Tensor:
    """One plain AR step (our baseline) on the same cache and bookkeeping (logprobs as in a cycle);
    with grammar ``masks``, from the distribution restricted to what each row's grammar allows; a
    step's prompt ``chunk`` rides in its forward."""
    model, cache, st = dev.model, dev.cache, dev.state
    n = _write_offsets(cache, st, slots)
    pos = n[:, None]                                                          # [b, 1]
    view = BlockBatch(None if plan.all_slots else slots, pos, plan.kv_len)
    hidden = ar_forward(model, cache, dev.backend, st.prompt_hidden, st.anchor[slots][:, None], view, chunk)
    logits = model.logits(hidden)                                            # [b, 1, V]
    masked = logits if masks is None else constrain(logits, masks.first[:, None])
    masked = _target(masked, st, slots, plan.paths, st.out_count[slots], st.penalties(slots, plan.paths))
    if plan.paths.all_greedy:
        nxt = masked[:, 0].argmax(-1)
    else:
        p = process(masked, st.sampling(slots, plan.paths))
        nxt = sample(p, rng.uniforms(st.seed[slots], st.counter[slots] + 1, rng.STREAM_AR, 1))[:, 0]
    lp = None if plan.logprobs is None else logprobs.block(st, slots, logits, nxt[:, None], plan.logprobs)
    return _commit(dev, slots, nxt[:, None], torch.zeros_like(n), nxt, lp, plan.paths, torch.zeros_like(n))


def settle(dev: DeviceParts, slots: torch.Tensor, width: int, lp_width: int | None) -> torch.Tensor:
    """Pack rows that were complete after their prefill (they take no part in the iteration) in the
    iteration's layout: their first token, reason and, with ``lp_width``, its logprobs; nothing else."""
    st = dev.state
    none = torch.zeros((slots.shape[0], width), dtype=torch.long, device=slots.device)   # [d, W]
    zero = none[:, 0]
    first = st.first[slots]
    st.first.index_fill_(0, slots, -1)
    packed = pack(none, n_emit=zero, n_acc=zero, reason=st.reason[slots], alive=zero, first=first,
                  n_ver=zero)                                                 # [d, W + 6]
    return packed if lp_width is None else torch.cat([packed, logprobs.first_block(st, slots, width, lp_width)], 1)
