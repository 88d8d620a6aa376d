"""ModelRunner: everything on the device, behind one call — ``execute(step) -> StepOutput``.

The scheduler (host) decides *what* a step is and writes it down as a ``ScheduledStep``; the runner
owns *how* it runs: the model, the KV cache (plain storage), the one attention backend chosen at
construction, the draft proposer, the per-slot device state, the staging buffers and the captured
CUDA graphs. Every device write happens here or in the kernels it calls. A static-shape
iteration's graph is keyed by its :class:`IterationPlan` itself, so no flag that changes the device
work can be left out of the key.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from orthrus.engine.device import admission, kernels
from orthrus.engine.device.graphs import CycleGraphs, key_bound, pad_slots
from orthrus.engine.device.masks import IterationMasks, from_staged, to_staged
from orthrus.engine.device.plan import DeviceParts, IterationPlan
from orthrus.engine.device.prefill import ChunkForward
from orthrus.engine.device.proposer import DiffusionProposer, Proposer
from orthrus.engine.device.slot_state import SlotState
from orthrus.engine.device.staging import HostStaging
from orthrus.engine.packed import Packed
from orthrus.engine.row_settings import RAGGED
from orthrus.engine.settings import EngineSettings
from orthrus.engine.step import AR, Admission, Iteration, PrefillWork, ScheduledStep, StepOutput
from orthrus.model.backends import AttentionBackend, choose_backend
from orthrus.engine.device.kv_sizing import check_pool, pool_tokens
from orthrus.model import compiled
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM

KEY_BUCKET = 128   # eager GPU attention: key lengths rounded up to a multiple of this (no token changes)


@dataclass(frozen=True)
class PlacedIteration:
    """An iteration placed on the device: its ``plan`` (the graph key), the ``rows`` it runs (padded
    on the static path), and where each live row's result sits among them (None: the same rows)."""

    plan: IterationPlan
    rows: np.ndarray
    where: np.ndarray | None


class ModelRunner:
    """The device side of one engine: model, cache, backend, proposer, slot state and graphs."""

    def __init__(self, parts: DeviceParts, static_shapes: bool, compile: bool = False) -> None:
        self.parts, self.static_shapes = parts, static_shapes
        # compile: every forward's layers run inductor's pieces (model/compiled.py; a CUDA graph
        # captures their kernels)
        self.layer_fns = compiled.layer_fns(parts.model.lm_head.weight.dtype) if compile else None
        self.cache, self.backend, self.state = parts.cache, parts.backend, parts.state
        self.num_slots = parts.cache.num_slots
        device = parts.cache.lengths.device
        self.graphs = CycleGraphs(device)
        # Host→device transfers: one copy per admitting step, one per iteration (staging.py), and one
        # more in a cycle with grammar-constrained rows (their masks along the drafts).
        self.admission_staging = HostStaging(device)
        self.index_staging = HostStaging(device)
        self.mask_staging = HostStaging(device)
        # ... and the one extra read of such a cycle (its drafts) lands here.
        block = parts.cache.capacity - parts.max_seq_len          # the scratch block: the largest block size
        self.draft_readback = torch.empty(self.num_slots * block, dtype=torch.long, pin_memory=device.type == "cuda")

    @classmethod
    def create(cls, model: OrthrusForCausalLM, settings: EngineSettings, proposer: Proposer | None, stop_width: int,
               forced_thinking: tuple[int, ...] = ()) -> ModelRunner:
        """Allocate everything once for resolved ``settings``: the paged cache (``kv_cache_tokens``
        positions in pages of the backend's size, ``kv_sizing.pool_tokens`` when None; each slot
        addresses ``max_seq_len`` plus one scratch block), the slot state (``stop_width`` stop ids to
        start with), and the backend ``attention`` names ("auto" | "sdpa" | "flash") or is.
        ``forced_thinking``: the tokens a spent thinking budget forces (the think end first; () none)."""
        num_slots, block_size, max_seq_len = settings.max_batch_size, settings.block_size, settings.max_seq_len
        attention, static_shapes, kv_cache_tokens = settings.attention, settings.static_shapes, settings.kv_cache_tokens
        cfg, param = model.config, next(model.parameters())
        device, attn = param.device, model.model.layers[0].self_attn
        if not isinstance(attention, AttentionBackend):
            # Eager SDPA on a GPU attends to key lengths in multiples of KEY_BUCKET: kernel plans
            # (cuDNN) are built per shape, and the exact length changes almost every iteration. On a
            # CPU the extra (masked) keys would only cost compute, so lengths stay exact there.
            bucket = settings.key_bucket or (KEY_BUCKET if device.type == "cuda" else 1)
            attention = choose_backend(attention, device, param.dtype, attn.num_heads, attn.num_kv_heads,
                                       attn.head_dim, bucket)
        capacity, page = max_seq_len + block_size, attention.page_size
        per_token = 2 * cfg.num_hidden_layers * attn.num_kv_heads * attn.head_dim * param.element_size()
        tokens = kv_cache_tokens if kv_cache_tokens is not None else pool_tokens(num_slots, capacity, page, per_token, device)
        check_pool(tokens, capacity, page)
        cache = PagedKVCache(cfg.num_hidden_layers, num_slots, attn.num_kv_heads, attn.head_dim, capacity,
                             1 + -(-tokens // page), page, param.dtype, device)
        # Static shapes (CUDA graphs) by default on CUDA with either backend: an eager iteration is
        # launch-bound (H200, 1.7B shape: ~30 ms per forward at any B and T), and a replayed one was
        # measured 3.9-4.4x faster in AR steps with SDPA, at 1,056 and at 8,224 keys of capacity
        # (static SDPA reads a power-of-two key bound, graphs.key_bound, not the whole capacity).
        static = device.type == "cuda" if static_shapes is None else bool(static_shapes)
        state = SlotState(num_slots, stop_width, device, cfg.hidden_size, param.dtype, forced_thinking)
        parts = DeviceParts(model, cache, attention, proposer or DiffusionProposer(model), state, max_seq_len)
        return cls(parts, static, settings.compile)

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run one step (:meth:`_execute`), with the compiled layer pieces if the engine compiles; a
        step in which dynamo compiled graphs reports its wall time as ``compile_ms``."""
        if self.layer_fns is None:
            return self._execute(step)
        graphs, started = compiled.graphs_compiled(), time.perf_counter()
        with compiled.using(self.layer_fns):
            out = self._execute(step)
        if compiled.graphs_compiled() == graphs:
            return out
        return replace(out, compile_ms=int((time.perf_counter() - started) * 1000))

    def _execute(self, step: ScheduledStep) -> StepOutput:
        """Run one step: mark ``step.kill`` dead, seat the admission, run the iteration with the
        step's prompt chunks in its AR forward (or the chunks alone), sample the completed prompts'
        first tokens, pack the settled rows, and read the iteration's rows and the settled ones back
        in ONE transfer (the step's one sync) → the packed rows of ``step.rows``, in that order."""
        it, work = step.iteration, step.prefill
        sitting_out = np.concatenate([step.settled, step.paused]) if len(step.paused) else step.settled
        placed = self.plan(it, step.logprobs, sitting_out) if it is not None else None
        plan, rows, where = (placed.plan, placed.rows, placed.where) if placed is not None else (None, None, None)
        idx = self._stage_indices(step, plan, rows)
        if "pages" in idx:                      # before anything reads or writes a page this step
            self.cache.set_entries(idx["pages"])
        if "kill" in idx:
            self.state.alive.index_fill_(0, idx["kill"], False)
        if step.admission is not None:
            self._make_room(step.admission)
            copy = admission.seat(step.admission, self.admission_staging, self.state)
            if copy is not None:
                copy.apply(self.cache, self.state.prompt_hidden)
        chunk = admission.chunk_forward(work, idx) if work is not None else None
        started = time.perf_counter()
        graphed = plan is not None and self.static_shapes and where is not None and not plan.constrained
        # Chunks ride in the iteration's AR forward, except ahead of an idle engine's first cycle and
        # beside a graphed iteration (a captured graph has fixed shapes: until graphs are captured
        # per token-count bucket, the chunks run in a forward of their own before it).
        alone = work is not None and (work.ahead or plan is None or graphed)
        if alone:
            self._prefill(work, chunk, idx, alone=True)
        parts = []
        if plan is not None:
            rides = work is not None and not alone
            parts.append(self._iterate(plan, it, rows, idx, rides or not graphed, chunk if rides else None))
            if rides:
                self._prefill(work, chunk, idx, alone=False)
        slots = (0 if work is None else work.tokens, 0 if plan is None else plan.forward_tokens)
        if not step.reads:
            return StepOutput(None, started, *slots)
        if len(step.settled):
            width = plan.width if plan is not None else 1
            parts.append(kernels.settle(self.parts, idx["settled"], width, step.logprobs))
        host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().numpy()  # SYNC: the one read per step
        if where is not None:
            n = len(rows)
            host = np.concatenate([host[:n][where], host[n:]]) if len(step.settled) else host[where]
        return StepOutput(Packed.unpack(host, step.logprobs), started, *slots)

    def _prefill(self, work: PrefillWork, chunk: ChunkForward | None, idx: dict[str, torch.Tensor], alone: bool) -> None:
        """The prefill's chunks in a forward of their own (``alone``; else they rode in the
        iteration's), then the copies for identical prompts and the completed rows' first tokens."""
        if alone and chunk is not None:
            kernels.prefill_chunks(self.parts, chunk)
        late = admission.prefix_copy("late.", work.copies, idx)
        if late is not None:                    # identical prompts take a completed row's partial page, hidden
            late.apply(self.cache, self.state.prompt_hidden)
        if len(work.done):
            masks = None if work.first_masks is None else from_staged(idx["first_masks"], work.first_masks.shape)
            kernels.sample_first(self.parts, idx["done"], idx["done_lens"], masks, work.paths, work.logprobs)

    def _stage_indices(self, step: ScheduledStep, plan: IterationPlan | None, rows: np.ndarray | None
                       ) -> dict[str, torch.Tensor]:
        """The step's indices, prompt chunks and first masks in ONE host→device copy (a static
        iteration's rows then go on into its graph's buffer on the device): a second copy through
        the same staging buffer would wait for the first."""
        staged = {"kill": step.kill} if len(step.kill) else {}
        if plan is not None:
            staged["rows"] = rows
        if len(step.settled):
            staged["settled"] = step.settled
        if plan is not None and plan.constrained:
            staged["masks"] = to_staged(step.iteration.first_masks)
        if len(step.pages):
            staged["pages"] = step.pages
        work = step.prefill
        if work is not None:
            staged.update(admission.chunk_arrays(work))
            if len(work.done):
                staged.update(done=work.done, done_lens=work.done_lens)
            if work.first_masks is not None:
                staged["first_masks"] = to_staged(work.first_masks)
        return self.index_staging.stage(staged) if staged else {}

    def plan(self, it: Iteration, logprobs: int | None, busy: np.ndarray) -> PlacedIteration:
        """Place an iteration with a logprob width of ``logprobs``. A static iteration is padded to
        its bucket with free slots (never those in ``busy``: rows that sit it out) unless it is
        constrained (never captured) or too few slots are free; it then runs eagerly."""
        constrained = it.grammar is not None
        # rows in slot order: an all-slots iteration reads the cache as slot i = row i (no gather)
        assert (np.diff(it.slots) > 0).all(), "an iteration's rows are ascending slots"
        padding = pad_slots(it.slots, self.num_slots, busy) if self.static_shapes and not constrained else None
        if padding is None:
            return PlacedIteration(IterationPlan(it.block, len(it.slots), len(it.slots) == self.num_slots, it.kv_len,
                                                 it.paths, logprobs, constrained, it.verify_budget(len(it.slots))),
                                   it.slots, None)
        padded, where = padding.rows, padding.where
        # flash bounds keys per row inside the kernel: one graph for every length (kv_len unused)
        keys = self.cache.capacity if self.backend.name == "flash" else key_bound(it.kv_len, self.cache.capacity)
        return PlacedIteration(IterationPlan(it.block, len(padded), len(padded) == self.num_slots, keys, it.paths,
                                             logprobs, constrained, it.verify_budget(len(padded))), padded, where)

    def _iterate(self, plan: IterationPlan, it: Iteration, rows: np.ndarray, idx: dict[str, torch.Tensor],
                 eager: bool, chunk: ChunkForward | None) -> torch.Tensor:
        """The iteration's device work → packed ``[rows, W + 6 (+ logprobs)]``: eagerly, with the
        constrained rows' grammar masks or prompt chunks, or through the graph of its plan."""
        if plan.constrained:
            first = from_staged(idx["masks"], it.first_masks.shape)
            masks = IterationMasks(it.grammar, rows, first, self.mask_staging, self.draft_readback)
            return self.device_iteration(plan, idx["rows"], masks, chunk)
        if eager:
            return self.device_iteration(plan, idx["rows"], None, chunk)
        return self.graphs.run(plan, idx["rows"], lambda s: self.device_iteration(plan, s))

    def device_iteration(self, plan: IterationPlan, slots: torch.Tensor, masks: IterationMasks | None = None,
                         chunk: ChunkForward | None = None) -> torch.Tensor:
        """The device work of one iteration over ``slots [rows]`` (with a step's prompt ``chunk`` in
        its AR forward) → packed ``[rows, W + 6 (+ logprobs)]`` (no host reads without ``masks``:
        this, without a chunk, is what a CUDA graph captures)."""
        if plan.block != AR:
            return kernels.speculative_cycle(self.parts, plan, slots, masks, chunk)
        return kernels.ar_step(self.parts, plan, slots, masks, chunk)

    def _make_room(self, adm: Admission) -> None:
        """Room in the slot state for an admission's ragged settings and, for penalised rows, their
        token counts (captured graphs hold the old buffers: forget them when one is replaced)."""
        grew = [self.state.widen(name, adm.params[name].shape[1]) for name in RAGGED]
        if len(adm.penalized):
            grew.append(self.state.track_penalties(self.parts.model.config.vocab_size))
        if any(grew):
            self.graphs.clear()

    def reset(self) -> None:
        """Every slot empty and dead."""
        self.state.reset()
        self.cache.reset()

