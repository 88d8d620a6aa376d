"""Requests of the streaming engine: what a caller submits, the host record of it, and what comes back."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from orthrus.engine.logprobs import TokenLogprobs
from orthrus.params import RowStats, SamplingParams


class FinishReason(IntEnum):
    """Why a row ended. The device packs RUNNING/STOP/LENGTH as ints; ABORT is host-only."""

    RUNNING = 0
    STOP = 1      # a stop token (EOS or stop_token_ids) or a stop string
    LENGTH = 2    # max_new_tokens or the context limit
    ABORT = 3     # abort_request
    ERROR = 4     # the row's own grammar failed mid-decode (``RequestOutput.error`` says why); host-only

    @property
    def label(self) -> str:
        """The public name: "stop" | "length" | "abort" | "error"."""
        return self.name.lower()


@dataclass(frozen=True)
class RequestOutput:
    """One finished request.

    ``token_ids``: generated ids; a stop token that ended the row is included, a stop string is not
    (the ids end where the decoded text ends right before it). ``text``: only for rows ended by a
    stop string, the decoded completion cut exactly before the stop string (a string that starts
    inside a token keeps that token's earlier characters here). ``stop_reason``: the stop string or
    stop token id that ended the row, else None.

    Logprobs (only for requests with ``SamplingParams.logprobs`` set, else all None):
    ``token_logprobs`` one per entry of ``token_ids``, the AR model's log-softmax of its raw logits
    at that position; ``top_logprobs`` per position the k most likely ``(token id, logprob)`` pairs,
    descending (None unless logprobs > 0); ``cumulative_logprob`` their sum.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str               # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None
    stats: RowStats
    seed: int
    text: str | None = None
    queue_seconds: float = 0.0       # from add_request to admission into a slot
    engine_seconds: float = 0.0      # from admission to finish
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None         # why a row ended with finish_reason "error" (its own failure)


# The result type of ``generate`` (kept for callers of the one-shot API).
GenerationResult = RequestOutput


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
    row: int = 0                     # index passed to the proposer (the prompt index in generate)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt, dtype=np.int64)

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
        return RequestOutput(self.request_id, token_ids, reason.label, stop_reason, stats, self.seed, text,
                             queue_seconds=admitted - self.arrival, engine_seconds=now - admitted, error=error, **lp)


class EngineStepError(RuntimeError):
    """A step's device work raised; ``request_ids`` were dropped (the engine was reset to empty)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause
