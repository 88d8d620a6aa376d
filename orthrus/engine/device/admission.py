"""Admission and prefill, device side: a host :class:`~orthrus.engine.step.Admission` staged in ONE
host→device copy and written into the slots' state, and a step's prompt chunks
(:class:`~orthrus.engine.step.PrefillWork`) as arrays for the step's index copy and back as a
:class:`~orthrus.engine.device.prefill.ChunkForward`."""
from __future__ import annotations

import numpy as np
import torch

from orthrus.engine.device.prefill import ChunkForward, PrefixCopy
from orthrus.engine.device.slot_state import SlotState
from orthrus.engine.device.staging import HostStaging
from orthrus.engine.row_settings import SETTINGS
from orthrus.engine.step import Admission, PrefillWork, PromptCopy
from orthrus.model.ragged import AttentionGroup, pad_layout


def _ints(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def seat(adm: Admission, staging: HostStaging, st: SlotState) -> PrefixCopy | None:
    """Stage everything the device needs to seat an admission in one copy and write the rows'
    settings (every row of ``row_settings.SETTINGS``; a ragged one padded to the state's width,
    which ``SlotState.widen`` made room for) into their slots' state, and start penalised rows'
    token counts (their prompts' tokens seen) → the copies from running slots to apply (None: none)."""
    parts = {"slots": _ints(adm.slots), **copy_arrays("", adm.copies)}
    for s in SETTINGS:
        value = adm.params[s.name]
        if s.ragged:
            wide = np.full((len(adm.slots), getattr(st, s.name).shape[1]), s.default, dtype=value.dtype)
            wide[:, : value.shape[1]] = value
            value = wide
        parts[f"s.{s.name}"] = value
    if len(adm.penalized):
        parts.update(penalized=adm.penalized, seen_slots=adm.seen_slots, seen_tokens=adm.seen_tokens)
    d = staging.stage(parts)
    slots = d["slots"]
    for s in SETTINGS:
        getattr(st, s.name)[slots] = d[f"s.{s.name}"]
    if len(adm.penalized):
        # index_fill_/index_put_ with device values: no Python scalar staged (testing/host_syncs.py)
        st.counts.index_fill_(0, d["penalized"], 0)
        st.seen.index_fill_(0, d["penalized"], False)
        st.seen.index_put_((d["seen_slots"], d["seen_tokens"]), torch.ones_like(d["seen_slots"], dtype=torch.bool))
    return prefix_copy("", adm.copies, d)


def copy_arrays(name: str, copies: tuple[PromptCopy, ...]) -> dict[str, np.ndarray]:
    """Host arrays of prompt copies (pages, and the hidden states of whole prompts) for a transfer."""
    whole = [c for c in copies if c.whole]
    pages = [c for c in copies if c.src_page >= 0]
    return {f"{name}src": _ints([c.src_page for c in pages]), f"{name}dst": _ints([c.dst_page for c in pages]),
            f"{name}hsrc": _ints([c.src for c in whole]), f"{name}hdst": _ints([c.dst for c in whole])}


def prefix_copy(name: str, copies: tuple[PromptCopy, ...], d: dict[str, torch.Tensor]) -> PrefixCopy | None:
    """The copies on the device, from the views of their transfer (None: no copy)."""
    return PrefixCopy(d[f"{name}src"], d[f"{name}dst"], d[f"{name}hsrc"], d[f"{name}hdst"]) if copies else None


def chunk_arrays(work: PrefillWork) -> dict[str, np.ndarray]:
    """Host arrays of a step's chunks (tokens, positions, attention groups, the rows whose prompt
    they complete) for the step's one index copy."""
    chunks = [c for g in work.groups for c in g]
    if not chunks:
        return copy_arrays("late.", work.copies)
    lens = _ints([len(c.rest) for c in chunks])
    ends = np.cumsum(lens) - 1
    arrays = {"c.tokens": np.concatenate([c.rest for c in chunks]).astype(np.int64),
              "c.positions": np.concatenate([c.start + np.arange(len(c.rest)) for c in chunks]),
              "c.slots": _ints([c.slot for c in chunks if c.last]),
              "c.last": ends[[i for i, c in enumerate(chunks) if c.last]], **copy_arrays("late.", work.copies)}
    for j, g in enumerate(work.groups):
        t = max(len(c.rest) for c in g)
        arrays[f"c.{j}.slots"] = _ints([c.slot for c in g])
        arrays[f"c.{j}.pos"] = _ints([c.start for c in g])[:, None] + np.arange(t)[None, :]   # [g, T]
        layout = pad_layout([len(c.rest) for c in g])
        if layout is not None:
            arrays[f"c.{j}.take"], arrays[f"c.{j}.put"] = layout
    return arrays


def chunk_forward(work: PrefillWork, d: dict[str, torch.Tensor]) -> ChunkForward | None:
    """The chunks on the device, from the views of the step's index copy (lengths are host-known)."""
    if not work.groups:
        return None
    groups, first = [], 0
    for j, g in enumerate(work.groups):
        count, t = sum(len(c.rest) for c in g), max(len(c.rest) for c in g)
        groups.append(AttentionGroup(d[f"c.{j}.slots"], d[f"c.{j}.pos"], first, count, max(c.start for c in g) + t,
                                     d.get(f"c.{j}.take"), d.get(f"c.{j}.put")))
        first += count
    return ChunkForward(d["c.tokens"], d["c.positions"], tuple(groups), d["c.slots"], d["c.last"])

