"""What the engine gives back: finished requests, their logprobs, finish reasons, step errors and
the engine's counters. Plain records (no torch): a caller that only reads results imports nothing
of the device side."""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

from orthrus.params import RowStats


class FinishReason(IntEnum):
    """Why a row ended. The device packs RUNNING/STOP/LENGTH as ints; ABORT and ERROR are host-only."""

    RUNNING = 0
    STOP = 1      # a stop token (EOS or stop_token_ids) or a stop string
    LENGTH = 2    # max_new_tokens or the context limit
    ABORT = 3     # abort_request
    ERROR = 4     # the row's own grammar failed mid-decode (``RequestOutput.error`` says why)

    @property
    def label(self) -> str:
        """The public name: "stop" | "length" | "abort" | "error"."""
        return self.name.lower()


@dataclass(frozen=True)
class TokenLogprobs:
    """One finished row's logprobs, aligned with its token ids."""

    token: list[float]
    top: list[list[tuple[int, float]]] | None      # None unless the row asked for k > 0

    @property
    def cumulative(self) -> float:
        """Sum of the token logprobs."""
        return float(sum(self.token))


@dataclass(frozen=True)
class RequestOutput:
    """One finished request.

    ``token_ids``: generated ids; a stop token that ended the row is included, a stop string is not
    (the ids end where the decoded text ends right before it). ``text``: the decoded completion
    (``skip_special_tokens=True``, the stop token that ended the row left out) whenever the engine
    has a tokenizer, else None; for a row ended by a stop string it is cut exactly before the stop
    string (a string that starts inside a token keeps that token's earlier characters here); None
    also for ids the tokenizer cannot decode. ``stop_reason``: the stop string or
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
    # Reasoning requests (``orthrus/reasoning.py``): generated tokens up to and including the think
    # end, all of them if it never came; None for a request without a reasoning phase.
    num_reasoning_tokens: int | None = None


# The result type of ``generate`` (kept for callers of the one-shot API).
GenerationResult = RequestOutput


class EngineStepError(RuntimeError):
    """A step's device work raised; ``request_ids`` were dropped (the engine was reset to empty)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters since it was built (``OrthrusEngine.stats``); ``later - earlier`` is
    what happened between two snapshots. Slot occupancy = ``busy_slot_iterations / iterations / B``."""

    iterations: int = 0              # decode iterations (cycles or AR steps over the batch)
    busy_slot_iterations: int = 0    # sum over iterations of the slots that decoded or prefilled in them
    admitting_steps: int = 0         # steps that seated waiting requests (one host→device copy each)
    prefill_tokens: int = 0          # prompt tokens computed by prefills (a shared prompt counts once)
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V was shared or copied instead
    page_iterations: int = 0         # sum over iterations of the KV pages rows held in them (mean: / iterations)
    preemptions: int = 0             # rows that gave their pages back for want of room (recomputed later)
    recomputed_tokens: int = 0       # K/V positions computed again for preempted rows
    # Token positions the layer stacks computed, padding included (host-known shapes): every
    # forward of both views, prefill and decode; and of those, the prefill forwards'. Beside
    # ``prefill_tokens + recomputed_tokens`` and the tokens generated they show the waste.
    forward_token_slots: int = 0
    prefill_token_slots: int = 0
    # Steps that read their device work back (ONE read each): the iterations, and steps that only
    # prefilled and sampled first tokens (a step of prompt chunks alone reads nothing).
    read_steps: int = 0
    # Drafts the cycles verified, and of those accepted (the verify forward's waste is the rest).
    verified_draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Milliseconds the compiled path spent compiling its layer pieces (or loading them from the disk
    # cache: a warm start counts its loads), ``OrthrusEngine(compile=True)``.
    compile_ms: int = 0

    def __sub__(self, earlier: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class KVPages:
    """The KV page pool at one moment (``OrthrusEngine.kv_pages``): ``total`` pages of ``page_size``
    tokens, ``in_use`` held by rows, ``cached`` held by nobody but kept for their prompt prefix
    (reused or evicted on demand), and the most ever held at once (``peak``)."""

    page_size: int
    total: int
    in_use: int
    cached: int
    peak: int
