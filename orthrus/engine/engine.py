"""OrthrusEngine: a streaming, batched, ragged, lossless self-speculative generation engine.

Requests come and go at any time (``add_request`` / ``abort_request``); each ``step`` is one
iteration, in nano-vllm's shape:

    step = scheduler.schedule()          host: kills, admission (prefix cache), the iteration's block
    output = runner.execute(step)        device: prefill, one cycle or AR step, ONE read of the result
    finished = scheduler.update(step, output)   host: slot table, grammars, stop strings, outputs

The records between them are in ``step.py``; the host side lives in ``host/`` (no torch), the
device side in ``device/``. ``generate`` is add + step until done.
"""
from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from orthrus.engine.device.runner import ModelRunner
from orthrus.engine.device.proposer import Proposer
from orthrus.engine.host.grammar import SlotGrammars
from orthrus.engine.host.request_checks import RequestChecks
from orthrus.engine.host.requests import Request
from orthrus.engine.host.scheduler import Scheduler
from orthrus.engine.host.stop_strings import StopStringScanner
from orthrus.engine.outputs import EngineStats, EngineStepError, KVPages, RequestOutput
from orthrus.engine.settings import EngineSettings, check_mode
from orthrus.model.backends import AttentionBackend
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM
from orthrus.params import SamplingParams
from orthrus.reasoning import ReasoningTokens


class OrthrusEngine:
    """At most ``max_batch_size`` rows in flight over one model and one paged KV cache allocated up front.

    Built from :class:`~orthrus.engine.settings.EngineSettings` (``settings``), each overridden by a
    keyword of its name (``OrthrusEngine(model, max_batch_size=16)``); ``self.settings`` is the
    resolved record. The settings:

    ``max_seq_len`` is the context limit (prompt + generated tokens); a row holds one extra block
    as scratch for the draft/verify writes. It defaults to the model's ``max_position_embeddings``
    capped at ``settings.DEFAULT_MAX_SEQ_LEN``. ``kv_cache_tokens``: the page pool's size in token positions
    (at least one row at full length); rows take pages as they grow, share prompt-prefix pages, and
    the newest rows are preempted (their K/V recomputed later, every token kept) when the pool runs
    short. None: every slot at full length on a CPU (nothing is ever preempted), what free memory
    holds on a GPU, capped there (``device/kv_sizing.py``). ``kv_pages`` reports its use.

    ``attention``: "sdpa" (masked SDPA over a host-known key bound), "flash" (FlashAttention's
    KV-cache kernel, per-row lengths, no mask) or "auto" (flash where it can run: CUDA, fp16/bf16,
    ``flash_attn`` importable), or an ``AttentionBackend`` instance. ``static_shapes``: pad every
    iteration to a bucket of rows and a fixed key bound, so that each is captured once as a CUDA
    graph and replayed (``device/graphs.py``); None = on for CUDA. On CPU it runs the same static
    path without capture (for tests).

    ``speculative``: True (Orthrus cycles of ``block_size``), False (plain AR, the baseline) or
    ``"auto"`` (per iteration, the block size K, K/2, … or AR step measured fastest at the current
    occupancy; see ``host/policy.py``). ``tokenizer``: needed for requests with stop strings or
    structured output. ``reasoning``: the think tokens whose phases requests are tracked by (True:
    the tokenizer's, if it has any; False: none), for ``RequestOutput.num_reasoning_tokens`` and
    ``SamplingParams.max_thinking_tokens`` (``orthrus/reasoning.py``). ``prefix_cache``: a prompt that starts like one a page or slot holds shares that K/V
    instead of computing it (``host/prefix_cache.py``); lossless; off only to measure it.

    ``max_num_batched_tokens``: the step's token budget (vLLM's name). Each step runs ONE AR forward
    over the running rows' blocks (a cycle's verify block or an AR step's token) and then chunks of
    the prompts being prefilled, oldest first, up to this many tokens in all (the oldest prompt gets
    at least a few tokens whatever the running rows take): a long prompt is prefilled over several
    steps while the other rows keep decoding (``host/prefilling.py``). None: 8,192 on a GPU, 2,048
    on a CPU.

    ``adaptive_verify``: a cycle verifies only as many of its drafts as pay, spent where the
    drafter is most confident (``device/verify_budget.py``), the number chosen per occupancy from
    measured step costs (``host/policy.py``'s ``VerifyPolicy``); exact either way. It adapts where
    every row of the cycle is greedy, or under ``"auto"`` (a sampled row's draws depend on it, as
    on the block size, so a seeded sampled row in fixed speculation verifies every draft). False:
    every draft, always.

    ``compile``: every forward's decoder layers run their work around attention (norms, projections,
    rotary, MLP, residuals) as inductor-compiled pieces, shape-generic and shared by every plan and
    layer (``model/compiled.py``); on CUDA the graphs capture the compiled kernels. Exact: the same
    tokens as eager. None = on for CUDA. The time steps spent compiling is ``stats.compile_ms``;
    compiled graphs are cached on local disk (``TORCHINDUCTOR_CACHE_DIR``, default
    ``~/.cache/orthrus/inductor``).

    Not thread-safe: one thread owns an engine (the pipeline's actor steps it in its own thread).
    """

    def __init__(self, model: OrthrusForCausalLM, settings: EngineSettings | None = None, *, tokenizer=None,
                 proposer: Proposer | None = None, reasoning: ReasoningTokens | bool = True, **overrides) -> None:
        # ``overrides``: settings by name (``OrthrusEngine(model, max_batch_size=16)``), over ``settings``;
        # a name EngineSettings does not have is a TypeError naming it.
        unknown = set(overrides) - set(EngineSettings.names())
        if unknown:
            raise TypeError(f"OrthrusEngine got unknown settings {sorted(unknown)}; "
                            f"EngineSettings has {list(EngineSettings.names())}")
        cfg = model.config
        device_type = next(model.parameters()).device.type
        base = settings if settings is not None else EngineSettings()
        self.settings = replace(base, **overrides).resolved(model.block_size, cfg.max_position_embeddings, device_type)
        s = self.settings
        self.block_size, self.max_seq_len, self.max_batch_size = s.block_size, s.max_seq_len, s.max_batch_size
        self.max_num_batched_tokens = s.max_num_batched_tokens
        self.model = model.eval()
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids: tuple[int, ...] = model.eos_token_ids
        self.reasoning = _reasoning_tokens(reasoning, tokenizer)
        self.runner = ModelRunner.create(model, s, proposer, len(self.eos_token_ids) + 8,
                                         self.reasoning.forced if self.reasoning else ())
        # Read-only copies of the runner's choices (it never changes them), for callers and reports.
        self.device = self.runner.cache.lengths.device
        self.attention = self.runner.backend.name      # "sdpa" | "flash": the kernel "auto" resolved to
        self.static_shapes = self.runner.static_shapes
        self.compile = self.runner.layer_fns is not None
        self.speculative = s.speculative
        # Grammar matchers of constrained rows (host); structured output needs the tokenizer's bytes.
        grammars = SlotGrammars(tokenizer, self.vocab_size, self.eos_token_ids, s.max_batch_size,
                                self.reasoning.end if self.reasoning else None)
        self.checks = RequestChecks(self.vocab_size, self.max_seq_len, tokenizer is not None, grammars)
        cache = self.runner.cache
        self.scheduler = Scheduler(s, self.vocab_size, grammars, StopStringScanner(tokenizer) if tokenizer else None,
                                   cache.num_pages, cache.page_size)

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
        self.check_request(prompt_token_ids, params)
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        if rid in self.scheduler.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        prompt = [int(t) for t in prompt_token_ids]
        reasoning = self.reasoning if self.reasoning and self.reasoning.opens_reasoning(prompt) else None
        self.scheduler.add(Request(rid, prompt, params, seed, reasoning=reasoning, eos=self.eos_token_ids))
        return rid

    def abort_request(self, request_id: str) -> None:
        """End a waiting or running request; the next ``step`` returns it once, ``finish_reason="abort"``,
        with the tokens it had, and its slot is free from that step on. Unknown or finished ids: no-op."""
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests are waiting, decoding, or aborted and not yet returned."""
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return int(self.scheduler.table.busy_mask.sum())

    @property
    def kv_pages(self) -> KVPages:
        """The KV page pool now: its size, pages held by rows, cached prefix pages and the peak held."""
        pool = self.scheduler.pool
        return KVPages(pool.page_size, pool.num_pages - 1, pool.in_use, len(pool.cached), pool.peak)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters so far (iterations, occupancy, prefill and prefix-cache tokens)."""
        return self.scheduler.stats

    def running_seconds(self) -> dict[str, float]:
        """Seconds each running request has held its slot (since admission), by request id; for
        callers that enforce a time limit with ``abort_request``. Host bookkeeping only."""
        now = time.perf_counter()
        return {rid: now - r.admitted for rid, r in self.scheduler.requests.items()
                if r.admitted is not None and not r.abort}

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: free aborted slots, seat waiting requests in free slots, one cycle or AR
        step over the running slots with prompt chunks in its AR forward (the token budget) → the
        requests that finished in it.

        A request whose own grammar fails mid-decode (a limit of the grammar engine no check at
        ``add_request`` foresaw) ends alone, ``finish_reason="error"`` with ``RequestOutput.error``
        saying why; the others go on exactly as without it.

        If the device work raises, every unfinished request is dropped (the engine is reset to
        empty, usable again) and :class:`EngineStepError` names them; its cause is the original error.
        """
        try:
            step = self.scheduler.schedule()
            return self.scheduler.update(step, self.runner.execute(step))
        except Exception as err:
            lost = list(self.scheduler.requests)
            self.reset()
            raise EngineStepError(lost, err) from err

    def reset(self) -> None:
        """Drop every request and empty every slot (nothing is returned for them)."""
        self.scheduler.reset()
        self.runner.reset()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 speculative: bool | str | None = None) -> list[RequestOutput]:
        """Generate for every prompt on an idle engine (add + step until done); results in prompt order.

        ``speculative`` overrides the engine's mode for this call (None = the engine's).
        """
        mode = self.speculative if speculative is None else speculative
        check_mode(mode)
        if self.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine; this one has unfinished requests (use step())")
        plist = self._validate(prompts, params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        self.scheduler.speculation.mode = mode
        try:
            while self.has_unfinished_requests():
                done.update((o.request_id, o) for o in self.step())
        finally:
            self.scheduler.speculation.mode = self.speculative
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

    @property
    def cache(self) -> PagedKVCache:
        """The KV cache (plain storage, owned by the runner)."""
        return self.runner.cache

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend chosen at construction."""
        return self.runner.backend

def _reasoning_tokens(reasoning: ReasoningTokens | bool, tokenizer) -> ReasoningTokens | None:
    """The think tokens requests' reasoning phases are tracked with: given, the tokenizer's (True), or none."""
    if isinstance(reasoning, ReasoningTokens):
        return reasoning
    if not isinstance(reasoning, bool):
        raise ValueError(f"reasoning must be a ReasoningTokens or a bool, got {reasoning!r}")
    return ReasoningTokens.from_tokenizer(tokenizer) if reasoning and tokenizer is not None else None
