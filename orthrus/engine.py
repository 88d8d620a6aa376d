"""OrthrusEngine: batched, ragged, lossless self-speculative generation with continuous refill.

The loop (host) per cycle: admit waiting prompts into free slots (one padded prefill), run one
speculative cycle (or AR step) on the occupied slots, read back ONE packed int tensor, fold it into
the numpy book, harvest finished rows. Device work lives in ``decode.py``, host bookkeeping in
``bookkeeping.py``.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import numpy as np
import torch

from orthrus import decode, flash
from orthrus.bookkeeping import SlotBook
from orthrus.cache import RaggedKVCache
from orthrus.graphs import CycleGraphs, pad_slots
from orthrus.model import OrthrusForCausalLM
from orthrus.params import GenerationResult, SamplingParams
from orthrus.policy import AR, SpeculationPolicy, halving_block_sizes
from orthrus.proposer import DiffusionProposer, Proposer


DEFAULT_MAX_SEQ_LEN = 8192
ATTENTION_KERNELS = ("auto", "sdpa", "flash")


class OrthrusEngine:
    """A fixed number of slots over one model and one ragged KV cache allocated up front.

    ``max_seq_len`` is the context limit (prompt + generated tokens); the cache holds one extra
    block per slot as scratch for the draft/verify writes. It defaults to the model's
    ``max_position_embeddings`` capped at ``DEFAULT_MAX_SEQ_LEN``: the cache is allocated up front
    for every slot, and a 40k-token context × 32 slots of a 1.7B model would not fit one GPU.

    ``attention``: "sdpa" (masked SDPA over a host-known key bound), "flash" (FlashAttention's
    KV-cache kernel, per-row lengths, no mask) or "auto" (flash where it can run: CUDA, fp16/bf16,
    ``flash_attn`` importable). ``static_shapes``: pad every iteration to a bucket of rows over the
    whole cache, so that each is captured once as a CUDA graph and replayed (``graphs.py``); None =
    on for CUDA with flash. On CPU it runs the same static path without capture (for tests).
    """

    def __init__(self, model: OrthrusForCausalLM, max_batch_size: int = 8, block_size: int | None = None,
                 max_seq_len: int | None = None, proposer: Proposer | None = None, attention: str = "auto",
                 static_shapes: bool | None = None) -> None:
        cfg = model.config
        self.block_size = int(block_size if block_size is not None else model.block_size)
        self.max_seq_len = int(max_seq_len if max_seq_len is not None
                               else min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN))
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft), got {self.block_size}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        self.model = model.eval()
        self.max_batch_size = max_batch_size
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids: tuple[int, ...] = model.eos_token_ids
        param = next(model.parameters())
        self.device = param.device
        attn = model.model.layers[0].self_attn
        self.cache = RaggedKVCache(cfg.num_hidden_layers, max_batch_size, attn.num_kv_heads,
                                   self.max_seq_len + self.block_size, attn.head_dim, param.dtype, self.device)
        self.cache.flash_kernel = self._flash_kernel(attention, param.dtype)
        self.attention = "sdpa" if self.cache.flash_kernel is None else "flash"
        # Static shapes pay off with flash, which reads only each row's own length; with SDPA every
        # forward would mask (and, below B rows, gather) the whole capacity, so it is opt-in there.
        default_static = self.device.type == "cuda" and self.attention == "flash"
        self.static_shapes = default_static if static_shapes is None else bool(static_shapes)
        self.graphs = CycleGraphs(self.device)
        self.proposer: Proposer = proposer if proposer is not None else DiffusionProposer(model)
        self.policy: SpeculationPolicy | None = None     # created by the first speculative="auto" call
        self.state = decode.SlotState(max_batch_size, len(self.eos_token_ids) + 8, self.device)
        self.iterations = 0   # decode iterations (cycles or AR steps over the batch) run so far

    def _flash_kernel(self, attention: str, dtype: torch.dtype) -> flash.KVCacheKernel | None:
        why_not = flash.unavailable_reason(self.device, dtype)
        if attention == "flash" and why_not:
            raise ValueError(f"attention='flash' is unavailable: {why_not}")
        return flash.kernel() if attention != "sdpa" and not why_not else None

    def _state_for(self, stop_width: int) -> decode.SlotState:
        """The engine's slot state, reset; widened (dropping captured graphs) if a call needs more stops."""
        if stop_width > self.state.stop_ids.shape[1]:
            self.state = decode.SlotState(self.max_batch_size, stop_width, self.device)
            self.graphs.clear()
        self.state.reset()
        return self.state

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if this prompt/params pair cannot be generated."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty (0 tokens)")
        ids = np.asarray(prompt_token_ids)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit max_seq_len={self.max_seq_len} "
                             "leaves no room to generate")

    def _validate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                  ) -> list[SamplingParams]:
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                self.check_request(prompt, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return plist

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 speculative: bool | str = True) -> list[GenerationResult]:
        """Generate for every prompt; results come back in prompt order.

        ``speculative``: True (Orthrus cycles of ``block_size``), False (plain AR, the baseline) or
        ``"auto"`` (per iteration, the block size K, K/2, … or AR step measured fastest at the current
        occupancy; see ``policy.py``).
        """
        if speculative not in (True, False, "auto"):
            raise ValueError(f"speculative must be True, False or 'auto', got {speculative!r}")
        plist = self._validate(prompts, params)
        seeds = [p.seed if p.seed is not None else secrets.randbits(63) for p in plist]
        stop_width = len(self.eos_token_ids) + max(len(p.stop_token_ids) for p in plist)
        st = self._state_for(stop_width)
        flags = (any(p.top_k > 0 or p.top_p < 1 for p in plist if not p.greedy), all(p.greedy for p in plist))
        book = SlotBook(self.max_batch_size, len(prompts), self.block_size, max(p.max_new_tokens for p in plist))
        # The policy outlives a call: costs are a property of this engine on this device, acceptance
        # of this model on this workload, and a batch job calls generate once per batch.
        if speculative == "auto" and self.policy is None:
            self.policy = SpeculationPolicy(halving_block_sizes(self.block_size))
        policy = self.policy if speculative == "auto" else None
        lens = [len(p) for p in prompts]
        results: list[GenerationResult | None] = [None] * len(prompts)
        self.cache.reset()
        while book.busy():
            if book.pending and (book.row < 0).any():
                slots, rows = book.admit(lens)
                self._prefill(st, slots, rows, prompts, plist, seeds, *flags)
            slots = book.occupied()
            k = policy.choose(len(slots)) if policy else (self.block_size if speculative else AR)
            start = time.perf_counter()
            packed_host = self._iterate(st, slots, book.kv_len(slots), k, *flags)
            self.iterations += 1
            done, reasons, tokens, live = book.record(slots, packed_host, k)
            if policy:
                policy.observe(k, len(slots), time.perf_counter() - start, tokens, live)
            for slot, reason in zip(done, reasons):
                row, res = book.harvest(int(slot), int(reason), seeds[book.row[slot]])
                results[row] = res
        return results  # type: ignore[return-value]

    def _iterate(self, st: decode.SlotState, slots: np.ndarray, kv_len: int, k: int, filtered: bool,
                 all_greedy: bool) -> np.ndarray:
        """A cycle with block size ``k`` (or an AR step, k = 0) over the occupied ``slots`` → their
        packed results, on the host."""
        if not self.static_shapes:
            packed = self._device_iteration(st, torch.as_tensor(slots, device=self.device),
                                            len(slots) == self.max_batch_size, kv_len, k, filtered, all_greedy)
            return packed.cpu().numpy()  # SYNC: the one device→host read per iteration
        padded, where = pad_slots(slots, self.max_batch_size)
        all_slots, capacity = len(padded) == self.max_batch_size, self.cache.capacity
        packed = self.graphs.run((k, len(padded), filtered, all_greedy), padded, lambda s: self._device_iteration(
            st, s, all_slots, capacity, k, filtered, all_greedy))
        return packed.cpu().numpy()[where]  # SYNC: the one device→host read per iteration

    def _device_iteration(self, st: decode.SlotState, slots_t: torch.Tensor, all_slots: bool, kv_len: int,
                          k: int, filtered: bool, all_greedy: bool) -> torch.Tensor:
        """The device work of one iteration over ``slots_t`` → packed result ``[b, W + 5]`` (no host reads)."""
        if k != AR:
            return decode.speculative_cycle(self.model, self.proposer, self.cache, st, slots_t, all_slots, kv_len,
                                            k, filtered, all_greedy, self.max_seq_len)
        return decode.ar_step(self.model, self.cache, st, slots_t, all_slots, kv_len, filtered, all_greedy,
                              self.max_seq_len)

    def _prefill(self, st: decode.SlotState, slots: np.ndarray, rows: list[int],
                 prompts: Sequence[Sequence[int]], plist: list[SamplingParams], seeds: list[int],
                 filtered: bool, all_greedy: bool) -> None:
        """Load admitted rows' parameters into their slots and prefill them in one padded batch."""
        dev = self.device
        ps = [plist[r] for r in rows]
        slots_t = torch.as_tensor(slots, device=dev)
        t = max(len(prompts[r]) for r in rows)
        padded = torch.zeros((len(rows), t), dtype=torch.long)
        for i, r in enumerate(rows):
            padded[i, : len(prompts[r])] = torch.as_tensor(list(prompts[r]), dtype=torch.long)
        stops = torch.full((len(rows), st.stop_ids.shape[1]), -1, dtype=torch.long)
        for i, p in enumerate(ps):
            ids = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
            stops[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        st.stop_ids[slots_t] = stops.to(dev)
        st.row[slots_t] = torch.as_tensor(rows, device=dev)
        st.seed[slots_t] = torch.as_tensor([seeds[r] for r in rows], device=dev)
        st.max_new[slots_t] = torch.as_tensor([p.max_new_tokens for p in ps], device=dev)
        st.temperature[slots_t] = torch.as_tensor([float(p.temperature) for p in ps], dtype=torch.float64, device=dev)
        st.top_p[slots_t] = torch.as_tensor([float(p.top_p) for p in ps], dtype=torch.float64, device=dev)
        st.top_k[slots_t] = torch.as_tensor([p.top_k for p in ps], device=dev)
        st.greedy[slots_t] = torch.as_tensor([p.greedy for p in ps], device=dev)
        lens = torch.as_tensor([len(prompts[r]) for r in rows], device=dev)
        decode.prefill(self.model, self.cache, st, slots_t, padded.to(dev), lens, filtered, all_greedy,
                       self.max_seq_len)
