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
from dataclasses import dataclass

import numpy as np
import torch

from orthrus.engine.decode import PrefillBatch, SlotState
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


def admission(slots: np.ndarray, reqs: list[Request], donors: dict[tuple[int, ...], int],
              eos_token_ids: tuple[int, ...], stop_width: int, staging: HostStaging
              ) -> tuple[PrefillBatch, SlotParams, int]:
    """Everything the device needs to seat ``reqs`` in ``slots``, given the prompts other slots hold
    intact (``donors``: prompt → slot), staged in ONE host→device copy → (the prefill batch, the
    slots' sampling parameters, prompt tokens the prefill computes)."""
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
    padded = np.zeros((len(distinct), t), dtype=np.int64)                      # [u, T], right-padded
    for i, p in enumerate(distinct):
        padded[i, : len(p)] = p
    ps = [r.params for r in reqs]
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    d = staging.stage({
        "slots": ints(slots), "row_lens": ints([len(r.prompt) for r in reqs]), "prompts": padded,
        "lens": ints([len(p) for p in distinct]), "owners": ints(owners), "copy_from": ints([c[0] for c in copies]),
        "copy_to": ints([c[1] for c in copies]), "donor_from": ints([c[0] for c in lent]),
        "donor_to": ints([c[1] for c in lent]), "stop_ids": _stops(reqs, eos_token_ids, stop_width),
        "row": ints([r.row for r in reqs]), "seed": ints([r.seed for r in reqs]),
        "max_new": ints([p.max_new_tokens for p in ps]), "top_k": ints([p.top_k for p in ps]),
        "temperature": np.asarray([p.temperature for p in ps], dtype=np.float64),
        "top_p": np.asarray([p.top_p for p in ps], dtype=np.float64),
        "greedy": np.asarray([p.greedy for p in ps], dtype=bool)})
    donor_len = max((len(r.key) for r in reqs if r.key in donors), default=0)
    batch = PrefillBatch(d["slots"], d["row_lens"], d["prompts"], d["lens"], d["owners"], d["copy_from"],
                         d["copy_to"], d["donor_from"], d["donor_to"], donor_len)
    params = SlotParams(d["stop_ids"], d["row"], d["seed"], d["max_new"], d["temperature"], d["top_p"],
                        d["top_k"], d["greedy"])
    return batch, params, sum(len(p) for p in distinct)


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
