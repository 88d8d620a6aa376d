"""Admission: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots. Requests admitted in the same step that share a prompt (typically the n
samples of one prompt, which the pipeline submits together) are prefilled once: the prompt's K/V
is computed into one slot and copied to the others on the device, while every request keeps its
own seed and random stream.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from orthrus.engine.decode import PrefillBatch, SlotState
from orthrus.engine.requests import Request


def admit(waiting: deque[Request], free: np.ndarray) -> tuple[np.ndarray, list[Request]]:
    """Pop as many waiting requests as there are free slots (FIFO) → (their slots, the requests)."""
    slots = free[: len(waiting)]
    return slots, [waiting.popleft() for _ in range(len(slots))]


def prefill_batch(slots: np.ndarray, reqs: list[Request], device: torch.device) -> PrefillBatch:
    """The device batch that prefills each distinct prompt of ``reqs`` once (see ``PrefillBatch``)."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in reqs]
    owners = [int(slots[source.index(i)]) for i in range(len(distinct))]
    copies = [(owners[s], int(slot)) for s, slot in zip(source, slots) if owners[s] != slot]
    t = max(len(p) for p in distinct)
    padded = torch.zeros((len(distinct), t), dtype=torch.long)                 # [u, T], right-padded
    for i, p in enumerate(distinct):
        padded[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)

    def long(xs: list[int]) -> torch.Tensor:
        return torch.as_tensor(xs, dtype=torch.long, device=device)
    return PrefillBatch(long(slots.tolist()), padded.to(device), long([len(p) for p in distinct]), long(source),
                        long(owners), long([c[0] for c in copies]), long([c[1] for c in copies]))


def load_slots(st: SlotState, slots: torch.Tensor, reqs: list[Request], eos_token_ids: tuple[int, ...]) -> None:
    """Write the admitted requests' sampling parameters, seeds and stop ids into their slots."""
    dev = slots.device
    stops = torch.full((len(reqs), st.stop_ids.shape[1]), -1, dtype=torch.long)
    for i, r in enumerate(reqs):
        ids = sorted(set(eos_token_ids) | set(r.params.stop_token_ids))
        stops[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    ps = [r.params for r in reqs]
    st.stop_ids[slots] = stops.to(dev)
    st.row[slots] = torch.as_tensor([r.row for r in reqs], device=dev)
    st.seed[slots] = torch.as_tensor([r.seed for r in reqs], device=dev)
    st.max_new[slots] = torch.as_tensor([p.max_new_tokens for p in ps], device=dev)
    st.temperature[slots] = torch.as_tensor([float(p.temperature) for p in ps], dtype=torch.float64, device=dev)
    st.top_p[slots] = torch.as_tensor([float(p.top_p) for p in ps], dtype=torch.float64, device=dev)
    st.top_k[slots] = torch.as_tensor([p.top_k for p in ps], device=dev)
    st.greedy[slots] = torch.as_tensor([p.greedy for p in ps], device=dev)
