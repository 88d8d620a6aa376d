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

_PARAMS = ("stop_ids", "seed", "max_new", "min_new", "think_at", "think_span", "top_k", "temperature", "top_p", "greedy")


def _ints(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def _stage_arrays(name: str, stage: StagePlan) -> dict[str, np.ndarray]:
    """Host arrays of one stage (its copy, each forward's rows) for the admission's one transfer."""
    whole = [c for c in stage.copies if c.whole]
    pages = [c for c in stage.copies if c.src_page >= 0]
    arrays = {f"{name}.src": _ints([c.src_page for c in pages]), f"{name}.dst": _ints([c.dst_page for c in pages]),
              f"{name}.hsrc": _ints([c.src for c in whole]), f"{name}.hdst": _ints([c.dst for c in whole])}
    for j, g in enumerate(stage.forwards):
        tokens = np.zeros((len(g), len(g[0].rest)), dtype=np.int64)            # [u, T], right-padded
        for i, r in enumerate(g):
            tokens[i, : len(r.rest)] = r.rest
        arrays.update({f"{name}.{j}.slots": _ints([r.slot for r in g]), f"{name}.{j}.tokens": tokens,
                       f"{name}.{j}.starts": _ints([r.start for r in g]), f"{name}.{j}.lens": _ints([len(r.rest) for r in g])})
    return arrays


def _device_stage(name: str, stage: StagePlan, d: dict[str, torch.Tensor]) -> PrefillStage:
    """The stage on the device, from the views of the one transfer (lengths are host-known)."""
    copy = None
    if stage.copies:
        copy = PrefixCopy(d[f"{name}.src"], d[f"{name}.dst"], d[f"{name}.hsrc"], d[f"{name}.hdst"])
    forwards = tuple(RestForward(d[f"{name}.{j}.slots"], d[f"{name}.{j}.tokens"], d[f"{name}.{j}.starts"],
                                 d[f"{name}.{j}.lens"], max(r.start for r in g) + len(g[0].rest))
                     for j, g in enumerate(stage.forwards))
    return PrefillStage(copy, forwards)


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
