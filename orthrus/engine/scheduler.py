"""Admission: which waiting requests get which free slots, and how their prompts are prefilled.

FIFO into free slots. A prompt is computed at most once while some slot holds it (typically the n
samples of one prompt, which the pipeline submits together): requests admitted in the same step
that share a prompt are prefilled once and the K/V copied to the others on the device; a request
whose prompt a *running* slot already holds (a sibling admitted in an earlier step) copies that
slot's prompt K/V and last hidden state and computes nothing; so does a request whose prompt a
*freed* slot still holds, where the engine knows nothing wrote there since (eager iterations only:
a static-shape iteration pads with free slots). Every request keeps its own seed and random stream,
so its first token is still its own sample. A running slot never writes its positions below the
prompt length.
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


def prefill_batch(slots: np.ndarray, reqs: list[Request], donors: dict[tuple[int, ...], int],
                  device: torch.device) -> tuple[PrefillBatch, int]:
    """The device batch that prefills ``reqs`` into ``slots`` (see ``PrefillBatch``), given the
    prompts other slots hold intact (``donors``: prompt → slot) → (batch, prompt tokens it computes)."""
    distinct: dict[tuple[int, ...], int] = {}
    owners: list[int] = []
    copies, lent = [], []                         # (from slot, to slot): after / before the forward
    for r, slot in zip(reqs, slots.tolist()):  # SYNC: none (host numpy)
        if r.key in donors:
            lent.append((donors[r.key], slot))
        elif r.key in distinct:
            copies.append((owners[distinct[r.key]], slot))
        else:
            distinct[r.key] = len(distinct)
            owners.append(slot)
    t = max((len(p) for p in distinct), default=0)
    padded = torch.zeros((len(distinct), t), dtype=torch.long)                 # [u, T], right-padded
    for i, p in enumerate(distinct):
        padded[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)

    def long(xs: list[int]) -> torch.Tensor:
        return torch.as_tensor(xs, dtype=torch.long, device=device)
    slot_list = slots.tolist()  # SYNC: none (host numpy)
    batch = PrefillBatch(long(slot_list), long([len(r.prompt) for r in reqs]), padded.to(device),
                         long([len(p) for p in distinct]), long(owners), long([c[0] for c in copies]),
                         long([c[1] for c in copies]), long([c[0] for c in lent]), long([c[1] for c in lent]),
                         max((len(r.key) for r in reqs if r.key in donors), default=0))
    return batch, sum(len(p) for p in distinct)


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
