"""Admission, device side: a host :class:`~orthrus.engine.step.Admission` staged in ONE host→device
copy and written into the slots' state (its prefill runs in ``kernels.prefill``)."""
from __future__ import annotations

import numpy as np
import torch

from orthrus.engine.device.masks import from_staged, to_staged
from orthrus.engine.device.prefill import PrefillBatch, PrefillStage, PrefixCopy, RestForward
from orthrus.engine.device.slot_state import SlotState
from orthrus.engine.device.staging import HostStaging
from orthrus.engine.step import Admission, SlotParams, StagePlan
from orthrus.model.ragged import AttentionGroup, RaggedBatch, pad_layout

_PARAMS = ("stop_ids", "seed", "max_new", "min_new", "think_at", "think_span", "top_k", "temperature", "top_p", "greedy")


def _ints(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def _stage_arrays(name: str, stage: StagePlan) -> dict[str, np.ndarray]:
    """Host arrays of one stage (its copy; its flat forward's tokens, rows and attention groups) for
    the admission's one transfer."""
    whole = [c for c in stage.copies if c.whole]
    pages = [c for c in stage.copies if c.src_page >= 0]
    arrays = {f"{name}.src": _ints([c.src_page for c in pages]), f"{name}.dst": _ints([c.dst_page for c in pages]),
              f"{name}.hsrc": _ints([c.src for c in whole]), f"{name}.hdst": _ints([c.dst for c in whole])}
    rows = [r for g in stage.groups for r in g]
    if not rows:
        return arrays
    lens = _ints([len(r.rest) for r in rows])
    arrays.update({f"{name}.tokens": np.concatenate([r.rest for r in rows]).astype(np.int64),
                   f"{name}.positions": np.concatenate([r.start + np.arange(len(r.rest)) for r in rows]),
                   f"{name}.slots": _ints([r.slot for r in rows]), f"{name}.last": np.cumsum(lens) - 1})
    for j, g in enumerate(stage.groups):
        t = max(len(r.rest) for r in g)
        arrays[f"{name}.{j}.slots"] = _ints([r.slot for r in g])
        arrays[f"{name}.{j}.pos"] = _ints([r.start for r in g])[:, None] + np.arange(t)[None, :]   # [g, T]
        layout = pad_layout([len(r.rest) for r in g])
        if layout is not None:
            arrays[f"{name}.{j}.take"], arrays[f"{name}.{j}.put"] = layout
    return arrays


def _device_stage(name: str, stage: StagePlan, d: dict[str, torch.Tensor]) -> PrefillStage:
    """The stage on the device, from the views of the one transfer (lengths are host-known)."""
    copy = None
    if stage.copies:
        copy = PrefixCopy(d[f"{name}.src"], d[f"{name}.dst"], d[f"{name}.hsrc"], d[f"{name}.hdst"])
    if not stage.groups:
        return PrefillStage(copy, None)
    groups, first = [], 0
    for j, g in enumerate(stage.groups):
        count, t = sum(len(r.rest) for r in g), max(len(r.rest) for r in g)
        groups.append(AttentionGroup(d[f"{name}.{j}.slots"], d[f"{name}.{j}.pos"], first, count,
                                     max(r.start for r in g) + t, d.get(f"{name}.{j}.take"), d.get(f"{name}.{j}.put")))
        first += count
    batch = RaggedBatch(d[f"{name}.positions"], tuple(groups))
    return PrefillStage(copy, RestForward(d[f"{name}.tokens"], batch, d[f"{name}.slots"], d[f"{name}.last"]))


def seat(adm: Admission, staging: HostStaging, st: SlotState) -> PrefillBatch:
    """Stage everything the device needs to seat an admission in one copy, write the rows' sampling
    parameters, seeds and stop ids into their slots' state (stop ids -1 padded to the state's width)
    → the prefill batch."""
    p = adm.params
    stops = np.full((len(adm.slots), st.stop_ids.shape[1]), -1, dtype=np.int64)
    stops[:, : p.stop_ids.shape[1]] = p.stop_ids
    parts = {"slots": _ints(adm.slots), "row_lens": _ints(adm.prompt_lens),
             **{f: getattr(p, f) for f in _PARAMS}, "stop_ids": stops}
    for i, plan in enumerate(adm.stages):
        parts.update(_stage_arrays(f"s{i}", plan))
    if adm.first_masks is not None:
        parts["masks"] = to_staged(adm.first_masks)
    d = staging.stage(parts)
    slots = d["slots"]
    for name in _PARAMS:
        getattr(st, name)[slots] = d[name]
    masks = None if adm.first_masks is None else from_staged(d["masks"], adm.first_masks.shape)
    stages = tuple(_device_stage(f"s{i}", plan, d) for i, plan in enumerate(adm.stages))
    return PrefillBatch(slots, d["row_lens"], stages, masks)


assert set(_PARAMS) == set(SlotParams.__dataclass_fields__), "every SlotParams field reaches the device"
