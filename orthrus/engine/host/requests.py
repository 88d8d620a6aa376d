"""The engine's host record of one request: its prompt, parameters, seed and bookkeeping."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from orthrus.engine.outputs import FinishReason, RequestOutput, TokenLogprobs
from orthrus.params import RowStats, SamplingParams
from orthrus.reasoning import ReasoningTokens


@dataclass
class Request:
    """The engine's host-side record of one request (mutable bookkeeping, never shared)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    slot: int = -1                   # -1 while waiting
    abort: bool = False              # abort_request was called; freed at the next step
    scanned: int = 0                 # generated tokens already searched for stop strings
    prompt_ids: np.ndarray = field(init=False, repr=False)   # the prompt as int64 (prefix cache lookups)
    prefix_hashes: list[int] | None = field(default=None, repr=False)   # its block hashes, once admitted
    reasoning: ReasoningTokens | None = None   # its think tokens, when its prompt opens a reasoning phase
    eos: tuple[int, ...] = ()        # the model's EOS ids

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt, dtype=np.int64)

    @property
    def think_at(self) -> int:
        """The generated index where its spent thinking budget forces the think end (-1: none)."""
        budget = self.params.max_thinking_tokens
        return budget if self.reasoning is not None and budget is not None else -1

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end it, ascending: EOS (unless ``ignore_eos``) and its own stop ids."""
        eos = () if self.params.ignore_eos else self.eos
        return tuple(sorted(set(eos) | set(self.params.stop_token_ids)))

    @property
    def think_span(self) -> int:
        """How many tokens its spent budget forces: the think end, then the template's separator
        unless a grammar decides the answer's first tokens (0: no budget)."""
        if self.think_at < 0:
            return 0
        return 1 if self.params.structured is not None else len(self.reasoning.forced)

    def output(self, token_ids: list[int], reason: FinishReason, stop_reason: str | int | None,
               stats: RowStats, text: str | None = None, logprobs: TokenLogprobs | None = None,
               error: str | None = None) -> RequestOutput:
        """This request's result, timed now (``logprobs`` aligned with ``token_ids``; none given for
        a request that asked for them means no tokens)."""
        now = time.perf_counter()
        admitted = self.admitted if self.admitted is not None else now
        k = self.params.logprobs
        if k is not None and logprobs is None:
            logprobs = TokenLogprobs([], [] if k > 0 else None)
        lp = {} if k is None else dict(token_logprobs=logprobs.token, top_logprobs=logprobs.top,
                                       cumulative_logprob=logprobs.cumulative)
        thinking = None if self.reasoning is None else self.reasoning.reasoning_length(token_ids)
        return RequestOutput(self.request_id, token_ids, reason.label, stop_reason, stats, self.seed, text,
                             queue_seconds=admitted - self.arrival, engine_seconds=now - admitted, error=error,
                             num_reasoning_tokens=thinking, **lp)
