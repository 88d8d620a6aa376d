"""Admission, host side: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots. A prompt prefix is computed at most once while some slot holds it (the prefix
cache, ``prefix_cache.py``): a request whose prompt starts like one a running slot, or a freed slot
with intact K/V, holds copies those positions and computes only the rest (nothing at all for an
identical prompt: the n samples of one row); requests admitted in the same step that share a
prefix compute it once, in the first of the step's two prefill stages (``device/prefill.py``), and
the others copy it. Every request keeps its own seed and random stream, so its first token is still
its own sample. The result is an :class:`~orthrus.engine.step.Admission`: plain arrays that the
runner moves to the device in one copy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from orthrus.engine.host.prefix_cache import PrefixIndex, block_hashes
from orthrus.engine.host.requests import Request
from orthrus.engine.step import PromptCopy, PromptRest, SlotParams, StagePlan


def admit(waiting: deque[Request], free: np.ndarray) -> list[Request]:
    """Pop as many waiting requests as there are free slots (FIFO); they take ``free`` in order."""
    return [waiting.popleft() for _ in range(min(len(waiting), len(free)))]


@dataclass(frozen=True)
class PromptPlan:
    """How an admission's prompts get their K/V: the two prefill stages, and the prompt tokens they compute."""

    stages: tuple[StagePlan, StagePlan]
    computed: int


def slot_params(reqs: list[Request], eos_token_ids: tuple[int, ...]) -> SlotParams:
    """The requests' sampling parameters as ``[n]`` arrays; ``stop_ids [n, S]``: EOS and each one's
    own stop ids, padded with -1 (S: the most any of them has)."""
    ids = [sorted(set(eos_token_ids) | set(r.params.stop_token_ids)) for r in reqs]
    stops = np.full((len(reqs), max(map(len, ids), default=0)), -1, dtype=np.int64)
    for i, row in enumerate(ids):
        stops[i, : len(row)] = row
    ps = [r.params for r in reqs]
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return SlotParams(stop_ids=stops, seed=ints([r.seed for r in reqs]), max_new=ints([p.max_new_tokens for p in ps]),
                      min_new=ints([p.min_tokens for p in ps]), think_at=ints([r.think_at for r in reqs]),
                      think_span=ints([r.think_span for r in reqs]), top_k=ints([p.top_k for p in ps]),
                      temperature=np.asarray([p.temperature for p in ps], dtype=np.float64),
                      top_p=np.asarray([p.top_p for p in ps], dtype=np.float64),
                      greedy=np.asarray([p.greedy for p in ps], dtype=bool))


def plan_prompts(slots: np.ndarray, reqs: list[Request], index: PrefixIndex | None, capacity: int) -> PromptPlan:
    """How each admitted prompt gets its K/V: copied from a slot that held its prefix before this
    step (stage 1's copy), or from a row computed in stage 1 (stage 2's copy), the rest computed;
    ``index`` None = no prefix cache (every prompt computed in full). Bounded by the admitted rows."""
    copies: tuple[list[PromptCopy], list[PromptCopy]] = ([], [])
    rests: tuple[list[PromptRest], list[PromptRest]] = ([], [])
    fresh = PrefixIndex(index.block) if index is not None else None   # rows stage 1 computes
    for r, slot in zip(reqs, slots.tolist()):  # SYNC: none (host numpy)
        prompt = r.prompt_ids
        if index is None:
            rests[0].append(PromptRest(slot, 0, prompt))
            continue
        hashes = r.prefix_hashes = block_hashes(prompt, index.block)   # kept: the index adds them after
        held, new = index.match(prompt, hashes), fresh.match(prompt, hashes)
        stage, m = (1, new) if new is not None and (held is None or new.length > held.length) else (0, held)
        if m is not None:
            copies[stage].append(PromptCopy(m.slot, slot, m.length, m.whole))
        start = 0 if m is None else m.length
        if start < len(prompt):
            rests[stage].append(PromptRest(slot, start, prompt[start:]))
        if stage == 0:
            fresh.add(slot, prompt, hashes)
    stages = tuple(StagePlan(tuple(c), _forward_groups(r, capacity)) for c, r in zip(copies, rests))
    return PromptPlan(stages, sum(len(r.rest) for rs in rests for r in rs))


def _forward_groups(rows: list[PromptRest], capacity: int) -> tuple[tuple[PromptRest, ...], ...]:
    """Rows of one stage in as few padded forwards as fit: start + padded length <= ``capacity``
    for every row of a forward (a pad token's K/V is written at its position). Bounded by rows."""
    groups: list[list[PromptRest]] = []
    for row in sorted(rows, key=lambda r: -len(r.rest)):
        g = groups[-1] if groups else None
        if g is not None and max(row.start, max(r.start for r in g)) + len(g[0].rest) <= capacity:
            g.append(row)
        else:
            groups.append([row])
    return tuple(tuple(g) for g in groups)
