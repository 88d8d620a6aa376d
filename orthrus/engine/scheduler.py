"""Admission: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots. A prompt prefix is computed at most once while some slot holds it (the prefix
cache, ``prefix_cache.py``): a request whose prompt starts like one a running slot, or a freed slot
with intact K/V, holds copies those positions and computes only the rest (nothing at all for an
identical prompt: the n samples of one row); requests admitted in the same step that share a
prefix compute it once, in the first of the step's two prefill stages (``prefill.py``), and the
others copy it. Every request keeps its own seed and random stream, so its first token is still its
own sample. Everything the device needs for one admission travels in one host→device copy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from orthrus.engine import grammar
from orthrus.engine.decode import SlotState
from orthrus.engine.prefill import PrefillBatch, PrefillStage, PrefixCopy, RestForward
from orthrus.engine.prefix_cache import PrefixIndex, block_hashes
from orthrus.engine.requests import Request
from orthrus.engine.staging import HostStaging


def admit(waiting: deque[Request], free: np.ndarray) -> tuple[np.ndarray, list[Request]]:
    """Pop as many waiting requests as there are free slots (FIFO) → (their slots, the requests)."""
    slots = free[: len(waiting)]
    return slots, [waiting.popleft() for _ in range(len(slots))]


def _stops(reqs: list[Request], eos_token_ids: tuple[int, ...], width: int) -> np.ndarray:
    """``[n, width]`` each request's stop ids (EOS and its own), padded with -1."""
    stops = np.full((len(reqs), width), -1, dtype=np.int64)
    for i, r in enumerate(reqs):
        ids = sorted(set(eos_token_ids) | set(r.params.stop_token_ids))
        stops[i, : len(ids)] = ids
    return stops


class PlannedCopy(NamedTuple):
    """Copy the first ``length`` prompt positions of slot ``src`` into slot ``dst``; ``whole``: the
    source holds this very prompt (its last hidden state is copied too)."""

    src: int
    dst: int
    length: int
    whole: bool


class PlannedRest(NamedTuple):
    """Compute ``rest`` (the prompt's tokens from position ``start``) into ``slot``."""

    slot: int
    start: int
    rest: np.ndarray


@dataclass
class _Stage:
    """Host plan of one prefill stage: copies, then the rows to compute."""

    copies: list[PlannedCopy] = field(default_factory=list)
    rows: list[PlannedRest] = field(default_factory=list)


def plan_prompts(slots: np.ndarray, reqs: list[Request], index: PrefixIndex | None) -> tuple[_Stage, _Stage]:
    """How each admitted prompt gets its K/V (``prefill.py``): copied from a slot that held its
    prefix before this step (stage 1's copy), or from a row computed in stage 1 (stage 2's copy),
    the rest computed; ``index`` None = no prefix cache (every prompt computed in full)."""
    first, second = _Stage(), _Stage()
    fresh = PrefixIndex(index.block) if index is not None else None   # rows stage 1 computes
    for r, slot in zip(reqs, slots.tolist()):  # SYNC: none (host numpy)
        prompt = r.prompt_ids
        if index is None:
            first.rows.append(PlannedRest(slot, 0, prompt))
            continue
        hashes = r.prefix_hashes = block_hashes(prompt, index.block)   # kept: the index adds them after
        held, new = index.match(prompt, hashes), fresh.match(prompt, hashes)
        if new is not None and (held is None or new.length > held.length):
            stage, m = second, new
        else:
            stage, m = first, held
        if m is not None:
            stage.copies.append(PlannedCopy(m.slot, slot, m.length, m.whole))
        start = 0 if m is None else m.length
        if start < len(prompt):
            stage.rows.append(PlannedRest(slot, start, prompt[start:]))
        if stage is first:
            fresh.add(slot, prompt, hashes)
    return first, second


Group = list[PlannedRest]   # the rows of one padded forward, longest rest first


def _forward_groups(rows: list[PlannedRest], capacity: int) -> list[Group]:
    """Rows of one stage in as few padded forwards as fit: start + padded length <= ``capacity``
    for every row of a forward (a pad token's K/V is written at its position). Bounded by rows."""
    groups: list[Group] = []
    for row in sorted(rows, key=lambda r: -len(r.rest)):
        g = groups[-1] if groups else None
        if g is not None and max(row.start, max(r.start for r in g)) + len(g[0].rest) <= capacity:
            g.append(row)
        else:
            groups.append([row])
    return groups


def _stage_arrays(name: str, stage: _Stage, groups: list[Group]) -> dict[str, np.ndarray]:
    """Host arrays of one stage (its copy, each forward's rows) for the admission's one transfer."""
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    whole = [c for c in stage.copies if c.whole]
    arrays = {f"{name}.src": ints([c.src for c in stage.copies]), f"{name}.dst": ints([c.dst for c in stage.copies]),
              f"{name}.hsrc": ints([c.src for c in whole]), f"{name}.hdst": ints([c.dst for c in whole])}
    for j, g in enumerate(groups):
        tokens = np.zeros((len(g), len(g[0].rest)), dtype=np.int64)            # [u, T], right-padded
        for i, r in enumerate(g):
            tokens[i, : len(r.rest)] = r.rest
        arrays.update({f"{name}.{j}.slots": ints([r.slot for r in g]), f"{name}.{j}.tokens": tokens,
                       f"{name}.{j}.starts": ints([r.start for r in g]), f"{name}.{j}.lens": ints([len(r.rest) for r in g])})
    return arrays


def _device_stage(name: str, stage: _Stage, groups: list[Group], d: dict[str, torch.Tensor]) -> PrefillStage:
    """The stage on the device, from the views of the one transfer (lengths are host-known)."""
    copy = None
    if stage.copies:
        copy = PrefixCopy(d[f"{name}.src"], d[f"{name}.dst"], max(c.length for c in stage.copies),
                          d[f"{name}.hsrc"], d[f"{name}.hdst"])
    forwards = tuple(RestForward(d[f"{name}.{j}.slots"], d[f"{name}.{j}.tokens"], d[f"{name}.{j}.starts"],
                                 d[f"{name}.{j}.lens"], max(r.start for r in g) + len(g[0].rest))
                     for j, g in enumerate(groups))
    return PrefillStage(copy, forwards)


def admission(slots: np.ndarray, reqs: list[Request], index: PrefixIndex | None,
              eos_token_ids: tuple[int, ...], stop_width: int, capacity: int, staging: HostStaging,
              first_masks: np.ndarray | None = None) -> tuple[PrefillBatch, SlotParams, int]:
    """Everything the device needs to seat ``reqs`` in ``slots``, given the prompt prefixes other
    slots hold (``index``), staged in ONE host→device copy → (the prefill batch, the slots' sampling
    parameters, prompt tokens the prefill computes). ``first_masks [n, W]``: the grammar masks of
    the rows' first tokens, when some row is constrained."""
    stages = plan_prompts(slots, reqs, index)
    ps = [r.params for r in reqs]
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    parts = {
        "slots": ints(slots), "row_lens": ints([len(r.prompt) for r in reqs]),
        "stop_ids": _stops(reqs, eos_token_ids, stop_width),
        "row": ints([r.row for r in reqs]), "seed": ints([r.seed for r in reqs]),
        "max_new": ints([p.max_new_tokens for p in ps]), "top_k": ints([p.top_k for p in ps]),
        "temperature": np.asarray([p.temperature for p in ps], dtype=np.float64),
        "top_p": np.asarray([p.top_p for p in ps], dtype=np.float64),
        "greedy": np.asarray([p.greedy for p in ps], dtype=bool)}
    groups = [_forward_groups(stage.rows, capacity) for stage in stages]
    for i, (stage, g) in enumerate(zip(stages, groups)):
        parts.update(_stage_arrays(f"s{i}", stage, g))
    if first_masks is not None:
        parts["masks"] = grammar.to_staged(first_masks)
    d = staging.stage(parts)
    masks = None if first_masks is None else grammar.from_staged(d["masks"], first_masks.shape)
    device_stages = tuple(_device_stage(f"s{i}", stage, g, d) for i, (stage, g) in enumerate(zip(stages, groups)))
    batch = PrefillBatch(d["slots"], d["row_lens"], device_stages, masks)
    params = SlotParams(d["stop_ids"], d["row"], d["seed"], d["max_new"], d["temperature"], d["top_p"],
                        d["top_k"], d["greedy"])
    return batch, params, sum(len(r.rest) for stage in stages for r in stage.rows)


@dataclass(frozen=True)
class SlotParams:
    """The admitted requests' sampling parameters, seeds and stop ids, on the device (``[n]``, ``[n, S]``)."""

    stop_ids: torch.Tensor
    row: torch.Tensor
    seed: torch.Tensor
    max_new: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor


def load_slots(st: SlotState, slots: torch.Tensor, p: SlotParams) -> None:
    """Write the admitted requests' sampling parameters, seeds and stop ids into their slots."""
    st.stop_ids[slots] = p.stop_ids
    st.row[slots], st.seed[slots], st.max_new[slots] = p.row, p.seed, p.max_new
    st.temperature[slots], st.top_p[slots], st.top_k[slots], st.greedy[slots] = p.temperature, p.top_p, p.top_k, p.greedy
