"""OrthrusEngine: a streaming, batched, ragged, lossless self-speculative generation engine.

Requests come and go at any time (``add_request`` / ``abort_request``); each ``step`` is one
iteration: admit waiting requests into free slots (one padded prefill, one per distinct prompt),
run one speculative cycle (or AR step) on the occupied slots, read back ONE packed int tensor (with
the rows' logprobs in it when any row asked: ``logprobs.py``), fold it into the numpy slot table,
scan the rows that have stop strings, and return the requests that finished. ``generate`` is add +
step until done. Device work lives in ``decode.py``, host bookkeeping in ``slot_table.py``,
admission and shared prefills in ``scheduler.py``, stop strings in ``stop_strings.py``.
"""
from __future__ import annotations

import secrets
import time
import uuid
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from orthrus.engine import scheduler
from orthrus.engine.grammar import SlotGrammars
from orthrus.engine.packed import Packed
from orthrus.engine.policy import AR, SpeculationPolicy, halving_block_sizes
from orthrus.engine.prefix_cache import PrefixIndex
from orthrus.engine.request_checks import RequestChecks
from orthrus.engine.proposer import Proposer
from orthrus.engine.requests import EngineStepError, FinishReason, Request, RequestOutput
from orthrus.engine.runner import ModelRunner
from orthrus.engine.slot_table import SlotTable
from orthrus.engine.stop_strings import StopHit, StopStringScanner
from orthrus.model.backends import AttentionBackend
from orthrus.model.cache import RaggedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM
from orthrus.params import RowStats, SamplingParams


DEFAULT_MAX_SEQ_LEN = 8192
ATTENTION_KERNELS = ("auto", "sdpa", "flash")
SPECULATIVE_MODES = (True, False, "auto")


class OrthrusEngine:
    """A fixed number of slots over one model and one ragged KV cache allocated up front.

    ``max_seq_len`` is the context limit (prompt + generated tokens); the cache holds one extra
    block per slot as scratch for the draft/verify writes. It defaults to the model's
    ``max_position_embeddings`` capped at ``DEFAULT_MAX_SEQ_LEN``: the cache is allocated up front
    for every slot, and a 40k-token context × 32 slots of a 1.7B model would not fit one GPU.

    ``attention``: "sdpa" (masked SDPA over a host-known key bound), "flash" (FlashAttention's
    KV-cache kernel, per-row lengths, no mask) or "auto" (flash where it can run: CUDA, fp16/bf16,
    ``flash_attn`` importable), or an ``AttentionBackend`` instance. ``static_shapes``: pad every iteration to a bucket of rows and a
    fixed key bound, so that each is captured once as a CUDA graph and replayed (``graphs.py``); None =
    on for CUDA. On CPU it runs the same static path without capture (for tests).

    ``speculative``: True (Orthrus cycles of ``block_size``), False (plain AR, the baseline) or
    ``"auto"`` (per iteration, the block size K, K/2, … or AR step measured fastest at the current
    occupancy; see ``policy.py``). ``tokenizer``: needed for requests with stop strings.
    ``prefix_cache``: a prompt that starts like one a slot holds copies that K/V instead of
    computing it (``prefix_cache.py``); lossless; off only to measure it.

    Not thread-safe: one thread owns an engine (the pipeline's actor steps it in its own thread).
    """

    def __init__(self, model: OrthrusForCausalLM, max_batch_size: int = 8, block_size: int | None = None,
                 max_seq_len: int | None = None, proposer: Proposer | None = None,
                 attention: str | AttentionBackend = "auto",
                 static_shapes: bool | None = None, speculative: bool | str = True, tokenizer=None,
                 key_bucket: int | None = None, prefix_cache: bool = True) -> None:
        cfg = model.config
        _check_mode(speculative)
        self.block_size = int(block_size if block_size is not None else model.block_size)
        self.max_seq_len = int(max_seq_len if max_seq_len is not None
                               else min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN))
        _check_sizes(max_batch_size, self.block_size, self.max_seq_len, attention)
        self.model = model.eval()
        self.max_batch_size = max_batch_size
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids: tuple[int, ...] = model.eos_token_ids
        self.runner = ModelRunner.create(model, max_batch_size, self.block_size, self.max_seq_len, attention,
                                         static_shapes, key_bucket, proposer, len(self.eos_token_ids) + 8)
        # Read-only copies of the runner's choices (it never changes them), for callers and reports.
        self.device = self.runner.cache.lengths.device
        self.attention = self.runner.backend.name      # "sdpa" | "flash": the kernel "auto" resolved to
        self.static_shapes = self.runner.static_shapes
        self.speculative = speculative
        # The policy outlives requests: costs are a property of this engine on this device,
        # acceptance of this model on this workload.
        self.policy: SpeculationPolicy | None = None     # created by the first "auto" step
        self.stops = StopStringScanner(tokenizer) if tokenizer is not None else None
        # Grammar matchers of constrained rows (host); structured output needs the tokenizer's bytes.
        self.grammars = SlotGrammars(tokenizer, self.vocab_size, self.eos_token_ids, max_batch_size)
        self.checks = RequestChecks(self.vocab_size, self.max_seq_len, tokenizer is not None, self.grammars)
        self.table = SlotTable(max_batch_size, self.block_size, self.max_seq_len, self.vocab_size)
        self._waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}         # every unfinished request, by id
        self._aborted: list[RequestOutput] = []         # waiting requests aborted, returned next step
        self._abort_slots: list[int] = []               # slots of running requests aborted, freed next step
        self._mode: bool | str = speculative            # the mode of the steps now running
        self.iterations = 0          # decode iterations (cycles or AR steps over the batch) run so far
        # Slots (running, or free with intact K/V) by the prompt prefixes they hold: prefix_cache.py.
        self.prefix_index = PrefixIndex() if prefix_cache else None
        self.prefill_tokens = 0      # prompt tokens computed by prefills (a shared prompt counts once)
        self.prefix_cache_hit_tokens = 0   # prompt tokens copied from a slot holding them instead of computed
        self.admitting_steps = 0     # steps that seated waiting requests (one host→device copy each)
        self._added = 0              # requests added so far (each one's row index for the proposer)
        self.busy_slot_iterations = 0   # sum over iterations of occupied slots (occupancy = this / iterations / B)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if this prompt/params pair cannot be generated."""
        self.checks.check(prompt_token_ids, params)

    def check_requests(self, token_ids: np.ndarray, offsets: np.ndarray, params: Sequence[SamplingParams]
                       ) -> list[str | None]:
        """:meth:`check_request` for many rows at once → each row's problem (the message it would
        raise) or None. The prompts come as one flat integer array and ``len(params) + 1`` row offsets
        into it (Arrow's list layout), so the id checks run column-wise, not one array per row."""
        return self.checks.problems(token_ids, offsets, params)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate (``ValueError`` naming the field) and queue a request → its id. Callable at any
        time, also between steps while other requests decode."""
        return self._add(prompt_token_ids, params, request_id, row=self._added)

    def _add(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None, row: int) -> str:
        self.check_request(prompt_token_ids, params)
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        self.runner.widen_stops(len(self.eos_token_ids) + len(params.stop_token_ids))
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(rid, [int(t) for t in prompt_token_ids], params, seed, row=row)
        self._requests[rid] = req
        self._waiting.append(req)
        self._added += 1
        return rid

    def abort_request(self, request_id: str) -> None:
        """End a waiting or running request; the next ``step`` returns it once, ``finish_reason="abort"``,
        with the tokens it had, and its slot is free from that step on. Unknown or finished ids: no-op."""
        req = self._requests.get(request_id)
        if req is None or req.abort:
            return
        req.abort = True
        if req.slot >= 0:
            self._abort_slots.append(req.slot)
        else:
            self._waiting.remove(req)
            del self._requests[request_id]
            self._aborted.append(req.output([], FinishReason.ABORT, None, RowStats(0, 0, 0, 0)))

    def has_unfinished_requests(self) -> bool:
        """Requests are waiting, decoding, or aborted and not yet returned."""
        return bool(self._requests) or bool(self._aborted)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return int(self.table.busy_mask.sum())

    def running_seconds(self) -> dict[str, float]:
        """Seconds each running request has held its slot (since admission), by request id; for
        callers that enforce a time limit with ``abort_request``. Host bookkeeping only."""
        now = time.perf_counter()
        return {rid: now - r.admitted for rid, r in self._requests.items() if r.admitted is not None and not r.abort}

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: free aborted slots, admit waiting requests into free slots (one padded
        prefill), one cycle or AR step over the occupied slots → the requests that finished in it.

        A request whose own grammar fails mid-decode (a limit of the grammar engine no check at
        ``add_request`` foresaw) ends alone, ``finish_reason="error"`` with ``RequestOutput.error``
        saying why; the others go on exactly as without it.

        If the device work raises, every unfinished request is dropped (the engine is reset to
        empty, usable again) and :class:`EngineStepError` names them; its cause is the original error.
        """
        finished, self._aborted = self._aborted, []
        try:
            finished += self._release_aborted()
            if self._waiting and not self.table.busy_mask.all():
                self._admit()
            slots = self.table.occupied()
            if len(slots):
                finished += self._decode(slots)
        except Exception as err:
            lost = list(self._requests)
            self.reset()
            raise EngineStepError(lost, err) from err
        return finished

    def reset(self) -> None:
        """Drop every request and empty every slot (nothing is returned for them)."""
        self._waiting.clear()
        self._requests.clear()
        self._aborted.clear()
        self._abort_slots.clear()
        if self.prefix_index is not None:
            self.prefix_index.clear()
        self.table = SlotTable(self.max_batch_size, self.block_size, self.max_seq_len, self.vocab_size)
        self.grammars.reset()
        self.runner.reset()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 speculative: bool | str | None = None) -> list[RequestOutput]:
        """Generate for every prompt on an idle engine (add + step until done); results in prompt order.

        ``speculative`` overrides the engine's mode for this call (None = the engine's).
        """
        mode = self.speculative if speculative is None else speculative
        _check_mode(mode)
        if self.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine; this one has unfinished requests (use step())")
        plist = self._validate(prompts, params)
        ids = [self._add(p, sp, None, row=i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        done: dict[str, RequestOutput] = {}
        self._mode = mode
        try:
            while self.has_unfinished_requests():
                done.update((o.request_id, o) for o in self.step())
        finally:
            self._mode = self.speculative
        return [done[i] for i in ids]

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

    def _release_aborted(self) -> list[RequestOutput]:
        """Free the slots of running requests that were aborted; mark them dead on the device."""
        slots, self._abort_slots = self._abort_slots, []
        if not slots:
            return []
        self.runner.kill(np.asarray(slots))
        return [self._output(slot, FinishReason.ABORT, None) for slot in slots]

    @property
    def cache(self) -> RaggedKVCache:
        """The KV cache (plain storage, owned by the runner)."""
        return self.runner.cache

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend chosen at construction."""
        return self.runner.backend

    def _output(self, slot: int, reason: FinishReason, hit: StopHit | None, error: str | None = None) -> RequestOutput:
        """Free ``slot`` and build its request's output (``error``: why it ended in error)."""
        req, tokens, stats = self.table.release(slot, *((hit.keep, hit.end) if hit else ()))
        lp = self.table.logprobs.release(slot, len(tokens))
        del self._requests[req.request_id]
        self.grammars.release(slot)
        # A freed slot keeps its prompt's K/V for later requests sharing a prefix of it, unless
        # something may write there: a static-shape iteration pads with free slots, and a row that
        # died at its prefill ran one dead iteration, which writes at the start of its slot.
        if self.prefix_index is not None and (self.static_shapes or self.table.ran_dead[slot]):
            self.prefix_index.remove(slot)
        if hit is not None:
            return req.output(tokens, FinishReason.STOP, hit.stop, stats, hit.text, lp)
        stop_reason = tokens[-1] if reason == FinishReason.STOP and tokens else None
        return req.output(tokens, reason, stop_reason, stats, logprobs=lp, error=error)

    def _decode(self, slots: np.ndarray) -> list[RequestOutput]:
        """One cycle (or AR step) over the occupied ``slots`` that can still generate, plus the rows
        admitted this step whose prefill already completed them → the requests that finished."""
        remaining = self.table.remaining(slots)
        # (a constrained row's masks need its first token on the host: it sits its first step out;
        # so does one whose grammar failed at admission, which ends below)
        done_at_prefill = (remaining <= 0) | self.grammars.awaiting_first(slots, self.table.count)
        if self.grammars.failed:
            done_at_prefill |= np.isin(slots, list(self.grammars.failed))
        settled, live = (slots[done_at_prefill], slots[~done_at_prefill]) if done_at_prefill.any() else (slots[:0], slots)
        lp = self.table.logprobs.width(slots)      # None: no row asked, no logprob work or transfer
        plan, rows, where, chosen, start = None, live, None, AR, time.perf_counter()
        if len(live):
            chosen, (filtered, all_greedy) = self._choose_block(len(live)), self.table.flags(live)
            # A block longer than any row can still accept is wasted work. Capping it changes a sampled
            # row's random draws (the draft block's length is part of them), so a seeded row would
            # depend on its batch-mates' budgets; greedy rows are the same tokens at any block size,
            # and "auto" already picks the size by occupancy.
            cap = all_greedy or self._mode == "auto"
            block = _cap_block(chosen, int(remaining.max())) if cap else chosen
            plan, rows, where = self.runner.plan(live, block, self.table.kv_len(live), filtered, all_greedy, lp,
                                                 self.grammars.any(live), settled)
        host = self.runner.iterate(plan, rows, where, settled, lp, self.grammars)
        out = Packed.unpack(host, lp)
        order = np.concatenate([live, settled]) if len(settled) else live
        if plan is not None:
            self.iterations += 1
            self.busy_slot_iterations += len(live)
            self.table.ran_dead[live[~out.alive[: len(live)]]] = True
        done, reasons, tokens, n_live = self.table.record(order, out, plan.block if plan else AR)
        if self.grammars.any(order):
            self.grammars.advance(order, self.table.generated)
        if plan is not None and self._mode == "auto" and plan.block == chosen:   # a capped block measures no arm
            self.policy.observe(chosen, len(live), time.perf_counter() - start, tokens, n_live)
        ended = dict(zip(done.tolist(), reasons.tolist()))  # SYNC: none (host numpy)
        hits = self._scan_stops(slots)
        failed = self.grammars.take_failed()      # rows whose own grammar failed: they end in error
        for s in failed:
            hits.pop(s, None)
        cut = [s for s in (*hits, *failed) if s not in ended]
        if cut:   # rows the host ended (a stop string, a failed grammar) while the device thinks they run
            self.runner.kill(np.asarray(cut))
        return [self._output(s, FinishReason.ERROR, None, failed[s]) if s in failed else
                self._output(s, FinishReason(ended.get(s, FinishReason.STOP)), hits.get(s))
                for s in sorted(set(ended) | set(hits) | set(failed))]

    def _choose_block(self, occupancy: int) -> int:
        """This iteration's block size by the mode: K, AR, or the "auto" policy's choice."""
        if self._mode != "auto":
            return self.block_size if self._mode else AR
        if self.policy is None:
            self.policy = SpeculationPolicy(halving_block_sizes(self.block_size))
        return self.policy.choose(occupancy)

    def _scan_stops(self, slots: np.ndarray) -> dict[int, StopHit]:
        """Stop strings found this iteration, by slot (only rows that have stop strings are decoded)."""
        hits: dict[int, StopHit] = {}
        for slot in slots[self.table.has_stops[slots]].tolist():  # SYNC: none (host numpy)
            req, tokens = self.table.requests[slot], self.table.generated(slot)
            if len(tokens) > req.scanned:
                hit = self.stops.scan(tokens, req.scanned, req.params.stop)
                req.scanned = len(tokens)
                if hit is not None:
                    hits[slot] = hit
        return hits

    def _admit(self) -> None:
        """Seat waiting requests in free slots (FIFO) and prefill them."""
        free, reqs = scheduler.admit(self._waiting, self.table.free_slots())
        now = time.perf_counter()
        for r in reqs:
            r.admitted = now
        self.table.admit(free, reqs)
        self._prefill(free, reqs)

    def _prefill(self, slots: np.ndarray, reqs: list[Request]) -> None:
        """Load admitted requests into their slots and prefill them, copying every prompt prefix
        some slot holds (the prefix cache) instead of computing it."""
        run = self.runner
        masks = self.grammars.admit(slots, [r.params.structured for r in reqs])
        batch, params, computed = scheduler.admission(slots, reqs, self.prefix_index, self.eos_token_ids,
                                                      run.state.stop_ids.shape[1], run.cache.capacity,
                                                      run.admission_staging, masks)
        if self.prefix_index is not None:    # after planning: the plan copies out of these slots' old K/V
            for slot, r in zip(slots.tolist(), reqs):  # SYNC: none (host numpy)
                self.prefix_index.add(slot, r.prompt_ids, r.prefix_hashes)
        scheduler.load_slots(run.state, batch.slots, params)
        run.prefill(batch, *self.table.flags(slots), self.table.logprobs.width(slots))
        self.prefill_tokens += computed
        self.prefix_cache_hit_tokens += sum(len(r.prompt) for r in reqs) - computed
        self.admitting_steps += 1


def _cap_block(block: int, remaining: int) -> int:
    """A block never longer than the rows can still accept: a cycle of K emits at most K tokens, so
    with at most ``remaining`` left anywhere K shrinks to it (an AR step when one token is left)."""
    if block == AR or remaining >= block:
        return block
    return remaining if remaining >= 2 else AR


def _check_sizes(max_batch_size: int, block_size: int, max_seq_len: int, attention: str | AttentionBackend) -> None:
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft), got {block_size}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    if not isinstance(attention, AttentionBackend) and attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")


def _check_mode(speculative: bool | str) -> None:
    if speculative not in SPECULATIVE_MODES or not isinstance(speculative, (bool, str)):
        raise ValueError(f"speculative must be True, False or 'auto', got {speculative!r}")
