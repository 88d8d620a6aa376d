"""ModelRunner: everything on the device, behind two calls — ``prefill`` and ``iterate(plan)``.

The engine (host) decides *what* an iteration is — which rows, which block size, which sampling
fast paths — and writes it down as an :class:`IterationPlan`; the runner owns *how* it runs: the
model, the KV cache (plain storage), the one attention backend chosen at construction, the draft
proposer, the per-slot device state, the staging buffer for slot indices and the captured CUDA
graphs. A static-shape iteration's graph is keyed by its plan itself, so no flag that changes the
device work can be left out of the key (a hand-built key that forgot one would replay the wrong
graph and give wrong tokens silently).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orthrus.engine import decode, grammar
from orthrus.engine.graphs import CycleGraphs, key_bound, pad_slots
from orthrus.engine.policy import AR
from orthrus.engine.prefill import PrefillBatch
from orthrus.engine.proposer import DiffusionProposer, Proposer
from orthrus.engine.staging import HostStaging
from orthrus.model.backends import AttentionBackend, choose_backend
from orthrus.model.cache import RaggedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM

KEY_BUCKET = 128   # eager GPU attention: key lengths rounded up to a multiple of this (no token changes)


@dataclass(frozen=True)
class IterationPlan:
    """What shapes one iteration's device work; host-known and hashable (the CUDA-graph key).

    ``block``: the cycle's block size K, or 0 (``AR``) for a plain AR step. ``rows``: rows of the
    forward (a padded bucket on the static path). ``all_slots``: the rows are every slot in order
    (copy-free cache reads). ``kv_len``: host-known bound on visible keys (on the static path a
    power of two with SDPA, ``graphs.key_bound``; the whole capacity with flash, which ignores it).
    ``filtered`` / ``all_greedy``: the sampling fast paths. ``logprobs``: the top-k
    width of the logprob block, None = no row asked. ``constrained``: some row has a grammar (its
    masks come from the host during the iteration, so such an iteration is never captured).
    """

    block: int
    rows: int
    all_slots: bool
    kv_len: int
    filtered: bool
    all_greedy: bool
    logprobs: int | None
    constrained: bool = False

    @property
    def width(self) -> int:
        """Emitted-token columns of its packed result (``packed.py``)."""
        return self.block if self.block != AR else 1


class ModelRunner:
    """The device side of one engine: model, cache, backend, proposer, slot state and graphs."""

    def __init__(self, model: OrthrusForCausalLM, cache: RaggedKVCache, backend: AttentionBackend,
                 proposer: Proposer, state: decode.SlotState, max_seq_len: int, static_shapes: bool) -> None:
        self.model, self.cache, self.backend, self.proposer = model, cache, backend, proposer
        self.state, self.max_seq_len, self.static_shapes = state, max_seq_len, static_shapes
        self.num_slots = cache.num_slots
        self.graphs = CycleGraphs(cache.lengths.device)
        # Host→device transfers: one copy per admitting step, one per iteration (staging.py), and one
        # more in a cycle with grammar-constrained rows (their masks along the drafts).
        self.admission_staging = HostStaging(cache.lengths.device)
        self.index_staging = HostStaging(cache.lengths.device)
        self.mask_staging = HostStaging(cache.lengths.device)
        # ... and the one extra read of such a cycle (its drafts) lands here.
        block = cache.capacity - max_seq_len          # the cache's scratch block: the largest block size
        self.draft_readback = torch.empty(self.num_slots * block, dtype=torch.long,
                                          pin_memory=cache.lengths.device.type == "cuda")

    @classmethod
    def create(cls, model: OrthrusForCausalLM, num_slots: int, block_size: int, max_seq_len: int,
               attention: str | AttentionBackend, static_shapes: bool | None, key_bucket: int | None,
               proposer: Proposer | None, stop_width: int) -> "ModelRunner":
        """Allocate everything once: the cache (``max_seq_len`` plus one scratch block per slot),
        the slot state, and the backend ``attention`` names ("auto" | "sdpa" | "flash") or is."""
        cfg, param = model.config, next(model.parameters())
        device, attn = param.device, model.model.layers[0].self_attn
        cache = RaggedKVCache(cfg.num_hidden_layers, num_slots, attn.num_kv_heads, max_seq_len + block_size,
                              attn.head_dim, param.dtype, device)
        if not isinstance(attention, AttentionBackend):
            # Eager SDPA on a GPU attends to key lengths in multiples of KEY_BUCKET: kernel plans
            # (cuDNN) are built per shape, and the exact length changes almost every iteration. On a
            # CPU the extra (masked) keys would only cost compute, so lengths stay exact there.
            bucket = key_bucket or (KEY_BUCKET if device.type == "cuda" else 1)
            attention = choose_backend(attention, device, param.dtype, attn.num_heads, attn.num_kv_heads,
                                       attn.head_dim, bucket)
        # Static shapes (CUDA graphs) by default on CUDA with either backend: an eager iteration is
        # launch-bound (H200, 1.7B shape: ~30 ms per forward at any B and T), and a replayed one was
        # measured 3.9-4.4x faster in AR steps with SDPA, at 1,056 and at 8,224 keys of capacity
        # (static SDPA reads a power-of-two key bound, graphs.key_bound, not the whole capacity).
        static = device.type == "cuda" if static_shapes is None else bool(static_shapes)
        state = decode.SlotState(num_slots, stop_width, device, cfg.hidden_size, param.dtype)
        return cls(model, cache, attention, proposer or DiffusionProposer(model), state, max_seq_len, static)

    def indices(self, slots: np.ndarray) -> torch.Tensor:
        """Slot indices on the device, through the loop's staging buffer (one non-blocking copy)."""
        return self.index_staging.stage({"slots": np.asarray(slots, dtype=np.int64)})["slots"]

    def kill(self, slots: np.ndarray) -> None:
        """Mark rows dead on the device (aborted, or cut by a stop string the host found)."""
        self.state.alive.index_fill_(0, self.indices(slots), False)

    def prefill(self, batch: PrefillBatch, filtered: bool, all_greedy: bool, lp_width: int | None) -> None:
        """Fill the admitted slots' prompts (``prefill.py``) and sample their first tokens."""
        decode.prefill(self, batch, filtered, all_greedy, lp_width)

    def plan(self, slots: np.ndarray, block: int, kv_len: int, filtered: bool, all_greedy: bool,
             logprobs: int | None, constrained: bool = False, busy: np.ndarray | None = None
             ) -> tuple[IterationPlan, np.ndarray, np.ndarray | None]:
        """The plan for one iteration over the occupied ``slots`` → (plan, the rows it runs, where
        each occupied slot's result sits among them; None when they are the same rows). ``busy``:
        other occupied slots, never used as padding. A static iteration is padded to its bucket
        unless it is constrained (never captured) or too few slots are free; it then runs eagerly."""
        padding = pad_slots(slots, self.num_slots, busy) if self.static_shapes and not constrained else None
        if padding is None:
            return (IterationPlan(block, len(slots), len(slots) == self.num_slots, kv_len, filtered, all_greedy,
                                  logprobs, constrained), slots, None)
        padded, where = padding
        # flash bounds keys per row inside the kernel: one graph for every length (kv_len unused)
        keys = self.cache.capacity if self.backend.name == "flash" else key_bound(kv_len, self.cache.capacity)
        return (IterationPlan(block, len(padded), len(padded) == self.num_slots, keys, filtered,
                              all_greedy, logprobs, constrained), padded, where)

    def device_iteration(self, plan: IterationPlan, slots: torch.Tensor,
                         masks: grammar.IterationMasks | None = None) -> torch.Tensor:
        """The device work of one iteration over ``slots [rows]`` → packed ``[rows, W + 5 (+ logprobs)]``
        (no host reads without ``masks``: this is what a CUDA graph captures)."""
        if plan.block != AR:
            return decode.speculative_cycle(self, plan, slots, masks)
        return decode.ar_step(self, plan, slots, masks)

    def iterate(self, plan: IterationPlan | None, rows: np.ndarray, where: np.ndarray | None,
                settled: np.ndarray, logprobs: int | None, grammars: grammar.SlotGrammars | None = None) -> np.ndarray:
        """Run ``plan`` over ``rows`` (None: no iteration), then pack the ``settled`` rows — admitted
        this step and already complete after their prefill, which take no part — and read both back in
        ONE transfer → host rows: the plan's occupied rows (in their order before padding), then ``settled``.
        A ``plan.constrained`` iteration takes its rows' grammar masks from ``grammars``."""
        parts = []
        eager = plan is not None and (not self.static_shapes or where is None)
        # One host→device copy for the iteration's indices (the static path's rows go through the
        # graph's own buffer): a second copy through the same staging buffer would wait for the first.
        staged = {"rows": rows} if eager else {}
        if len(settled):
            staged["settled"] = settled
        if plan is not None and plan.constrained:
            staged["masks"] = grammar.to_staged(grammars.first[rows])
        idx = self.index_staging.stage(staged) if staged else {}
        if plan is not None and plan.constrained:
            first = grammar.from_staged(idx["masks"], (len(rows), grammars.words))
            masks = grammar.IterationMasks(grammars, rows, first, self.mask_staging, self.draft_readback)
            parts.append(self.device_iteration(plan, idx["rows"], masks))
        elif plan is not None:
            parts.append(self.device_iteration(plan, idx["rows"]) if eager else
                         self.graphs.run(plan, rows, lambda s: self.device_iteration(plan, s)))
        if len(settled):
            parts.append(decode.settle(self, idx["settled"], plan.width if plan is not None else 1, logprobs))
        host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().numpy()  # SYNC: the one read per iteration
        if where is None:
            return host
        n = len(rows)
        return np.concatenate([host[:n][where], host[n:]]) if len(settled) else host[where]

    def widen_stops(self, width: int) -> None:
        """Room for ``width`` stop ids per slot (captured graphs hold the old buffer: forget them)."""
        if width > self.state.stop_ids.shape[1]:
            self.state.widen(width)
            self.graphs.clear()

    def reset(self) -> None:
        """Every slot empty and dead."""
        self.state.reset()
        self.cache.reset()
