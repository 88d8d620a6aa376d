"""Static-shape decode iterations, each captured once as a CUDA graph and replayed.

Why: at small batches a cycle is a few hundred small kernels (two forwards, sampling, acceptance,
commit); launching them one by one from Python costs more than running them. A CUDA graph replays
the whole iteration with one launch. Capture needs fixed shapes, fixed addresses and no host reads,
so the static path differs from the eager one in three ways only:

- rows: the occupied slots are padded to a bucket size (powers of two, capped at the slot count)
  with free slots. A free slot is dead (``alive`` is False), so its commit changes nothing, and the
  K/V its forward writes lands in a slot nobody reads until a prefill overwrites it. There are
  always enough free slots: ``bucket - occupied <= slots - occupied``.
- keys: every forward is bounded by each row's own length inside the kernel (flash), or (masked
  SDPA) sees the host-known bound rounded up to a power of two (``key_bound``), instead of the eager
  path's bound rounded to a multiple of 128: a few graphs per plan, and no iteration reads the whole
  capacity for short rows.
- state: the engine's ``SlotState``, cache and page table are allocated once, and the slot indices
  (staged with the step's other indices) are copied into a static buffer before each replay. Randomness is counter-based (``rng.py``): no generator
  state to capture.

The first iteration with a given key runs eagerly (its result is used) and doubles as the warm-up
capture needs; capture then records the same work without running it, so no state moves twice.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Callable, Hashable

import numpy as np
import torch

from orthrus.engine.step import occupancy_bucket

STATIC_MIN_KEYS = 256   # smallest key bound of a static SDPA iteration (fewer graphs for short rows)
GraphKey = Hashable   # the iteration's plan itself (plan.IterationPlan): every input that shapes the work


def bucket(occupancy: int, num_slots: int) -> int:
    """Rows a static iteration runs for ``occupancy`` live slots: the policy's bucket, capped."""
    return min(num_slots, occupancy_bucket(occupancy))


def key_bound(kv_len: int, capacity: int, floor: int = STATIC_MIN_KEYS) -> int:
    """Keys a static SDPA iteration attends: the next power of two of the host-known bound (at least
    ``floor``), capped at the capacity. A graph per bound (a few: log2(capacity / floor) + 1) reads
    the keys rows can have, not the whole capacity; keys past a row's length are masked either way."""
    return min(capacity, max(floor, occupancy_bucket(kv_len)))   # the next power of two


@dataclass(frozen=True)
class Padding:
    """A static iteration's ``rows`` (occupied slots and free ones, sorted) and where each occupied
    slot sits among them."""

    rows: np.ndarray
    where: np.ndarray


def pad_slots(occupied: np.ndarray, num_slots: int, busy: np.ndarray | None = None) -> Padding | None:
    """Occupied slots padded with free ones to the bucket size.
    Slots in ``busy`` (rows that hold a request but sit this iteration out) are never padding: a
    padding row's iteration clears its prefill token and would decode it if alive. None when too few
    slots are free to pad."""
    taken = occupied if busy is None else np.union1d(occupied, busy)
    free = np.setdiff1d(np.arange(num_slots), taken)
    need = bucket(len(occupied), num_slots) - len(occupied)
    if need > len(free):
        return None
    padded = np.sort(np.concatenate([occupied, free[:need]]))
    return Padding(padded, np.searchsorted(padded, occupied))


class CycleGraphs:
    """Runs static iterations: replays a captured CUDA graph per key, or runs eagerly (CPU, first use)."""

    def __init__(self, device: torch.device) -> None:
        self.capture = device.type == "cuda"
        self.device = device
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager_only: set[GraphKey] = set()
        self.slot_buffers: dict[int, torch.Tensor] = {}   # row count -> its static device buffer
        self.capture_failures: list[str] = []   # why a key runs eagerly (reported by jobs/gpu_check)
        self.pool = None

    def clear(self) -> None:
        """Forget every graph (the tensors they captured were reallocated)."""
        self.graphs.clear()
        self.eager_only.clear()
        self.pool = None

    def _slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy the (already staged) slot indices into the static device buffer of this row count:
        a device-to-device copy, so the step's one host→device transfer carries them."""
        n = rows.shape[0]
        if n not in self.slot_buffers:
            self.slot_buffers[n] = torch.empty(n, dtype=torch.long, device=self.device)
        buffer = self.slot_buffers[n]
        buffer.copy_(rows)
        return buffer

    def run(self, key: GraphKey, rows: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn(slots)`` → packed result, for the static slot buffer holding ``rows`` (on the device)."""
        slots = self._slots(rows)
        entry = self.graphs.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out
        if not self.capture or key in self.eager_only:
            return fn(slots)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):        # warm-up off the default stream, as capture requires
            result = fn(slots)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._capture(key, slots, fn)
        return result

    def _capture(self, key: GraphKey, slots: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Record ``fn`` as this key's graph; a key whose capture fails runs eagerly from then on."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            # thread_local: another thread's allocator calls (the actor's asyncio loop, Ray's
            # threads) cannot invalidate this capture; only this thread's unsafe calls fail it.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = fn(slots)              # recorded, not run: no state moves
        except RuntimeError as err:          # e.g. a custom proposer that syncs: slower, still exact
            # A capture that fails in its exit leaves the capture stream current: restore ours.
            torch.cuda.set_stream(stream)
            warnings.warn(f"CUDA graph capture failed for {key}; running it eagerly: {err}", stacklevel=3)
            self.capture_failures.append(f"{key}: {err}"[:300])
            self.eager_only.add(key)
            return
        self.pool = graph.pool()
        self.graphs[key] = (graph, out)
