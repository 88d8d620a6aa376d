"""Request parameters and per-row results of the engine (plain frozen dataclasses)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from orthrus.constraints import Constraint, parse_constraint
from orthrus.metrics import tokens_per_cycle

MAX_NEW_TOKENS_LIMIT = 1 << 20  # anything above is a typo, not a request
# Below these the engine's float32 arithmetic breaks (logits / T overflows, or the value rounds to
# 0 and divides by zero or empties the nucleus), so they are replaced by their limit: a temperature
# this small samples the argmax (greedy), a top_p this small keeps only the top token, as any
# top_p below the top token's probability does.
GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-30
MAX_LOGPROBS = 20   # most top log-probabilities a row may ask for per position
MAX_PENALTY = 2.0   # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_LOGIT_BIAS = 100.0   # a logit bias lies in [-100, 100] (OpenAI's range): -100 bans a token in effect


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one row. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable.

    Processing order (identical for the AR target and the diffusion proposal): temperature, top-k,
    top-p, softmax. A temperature in (0, 1e-5) is greedy and a top_p below 1e-30 is 1e-30 (top-1):
    their limits, where float32 arithmetic would otherwise overflow or divide by zero. ``seed`` keys the row's own random stream, so a seeded row samples the same
    tokens alone or in any batch; rows given the same seed and prompt give the same output.

    ``logprobs``: None = off; 0 = each generated token's log-probability; k > 0 = also the k most
    likely tokens at each position. Values are the log-softmax of the AR (target) model's raw logits,
    before temperature/top-k/top-p: what plain AR decoding of the same tokens reports.

    ``min_tokens``: no stop token (EOS or ``stop_token_ids``) before this many generated tokens
    (vLLM's meaning); the stop tokens are masked out of the target distribution at those positions,
    so under speculation a draft that is one is rejected and the output is still exact. Stop strings
    still apply. It cannot be combined with ``structured`` (a complete grammar may allow only EOS).

    ``max_thinking_tokens``: None = unbounded; N = once a request in its reasoning phase (see
    ``orthrus/reasoning.py``) has generated N tokens without the think end, the think end and the
    chat template's separator are forced (the target at those positions is that one token), then the
    answer begins. Exact under speculation: it equals plain AR decoding with the same intervention,
    and drafts past the forced position are rejected. Requests without a reasoning phase ignore it.
    With ``structured``, only the think end is forced: the grammar decides every answer token.

    ``structured``: None, or exactly one of ``{"json_schema": ...}``, ``{"regex": ...}``,
    ``{"choice": [...]}``, ``{"grammar": ...}`` (``constraints.py``; stored as a ``Constraint``). The
    row then samples from the model's distribution restricted to the tokens the grammar allows next,
    renormalised (the grammar mask applies to the logits before temperature/top-k/top-p), and ends
    "stop" only where the grammar is complete. A request in a reasoning phase thinks freely first
    (any token but EOS); its grammar applies from the token after its think end. Stop strings and extra stop token ids cannot be
    combined with it: they could end a row mid-record and report it as stopped.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()       # stop strings; need an engine built with a tokenizer
    logprobs: int | None = None      # None: off; 0: the token's log-probability; k: also the top k
    structured: Constraint | None = None   # given as {kind: value}; normalised in __post_init__
    min_tokens: int = 0              # no stop token before this many generated tokens
    max_thinking_tokens: int | None = None   # force the think end after this many reasoning tokens
    repetition_penalty: float = 1.0  # > 0; 1 = off; prompt and generated tokens
    presence_penalty: float = 0.0    # [-2, 2]; generated tokens
    frequency_penalty: float = 0.0   # [-2, 2]; generated tokens, per occurrence
    min_p: float = 0.0               # [0, 1]; relative to the top token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()   # given as {token_id: bias}; sorted pairs
    ignore_eos: bool = False         # EOS does not end the row

    @property
    def penalized(self) -> bool:
        """True when a penalty asks for something (the row needs its token counts)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(float(self.top_p), MIN_TOP_P))
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT):
            raise ValueError(f"SamplingParams.max_new_tokens must be an int in [1, {MAX_NEW_TOKENS_LIMIT}], "
                             f"got {self.max_new_tokens!r}")
        _check_seed(self.seed)
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(t, str) and t and "\ufffd" not in t for t in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        object.__setattr__(self, "structured", parse_constraint(self.structured))
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
                and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ValueError(f"SamplingParams.min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.structured is not None and self.min_tokens:
            raise ValueError("SamplingParams.min_tokens cannot be combined with structured: a complete grammar "
                             "may allow only EOS, which min_tokens forbids")
        if self.max_thinking_tokens is not None and not (
                isinstance(self.max_thinking_tokens, int) and not isinstance(self.max_thinking_tokens, bool)
                and self.max_thinking_tokens >= 0):
            raise ValueError(f"SamplingParams.max_thinking_tokens must be None or an int >= 0, "
                             f"got {self.max_thinking_tokens!r}")
        self._check_penalties()
        if self.structured is not None and self.ignore_eos:
            raise ValueError("SamplingParams.ignore_eos cannot be combined with structured: a constrained row "
                             "ends by EOS where its grammar is complete")
        if self.structured is not None and (self.stop or self.stop_token_ids):
            which = "stop" if self.stop else "stop_token_ids"
            raise ValueError(f"SamplingParams.{which} cannot be combined with structured: a constrained row "
                             "ends where its grammar is complete (a stop could cut it mid-record)")

    def _check_penalties(self) -> None:
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"SamplingParams.{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"SamplingParams.min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """True when the row decodes by argmax."""
        return self.temperature == 0

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These settings with another ``seed``. Only the seed is checked: the rest was checked when
        this object was made, so rows that share their settings (a batch job's usual case) cost one
        full validation, not one each."""
        _check_seed(seed)
        out = object.__new__(SamplingParams)     # a field copy: copy.copy's generic path costs ~10x more
        out.__dict__.update(self.__dict__, seed=seed)
        return out


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (or its pairs) as (token id, bias) pairs sorted by id, checked."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(t, b) for t, b in items]
    except (TypeError, ValueError):
        raise ValueError(f"SamplingParams.logit_bias must map token ids to biases, got {bias!r}"[:300]) from None
    for t, b in pairs:
        if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {t!r}"[:300])
        if not (_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            raise ValueError(f"SamplingParams.logit_bias values must be numbers in [-100, 100], got {b!r} "
                             f"for token {t}"[:300])
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("SamplingParams.logit_bias lists a token id twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))


def _check_seed(seed: object) -> None:
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2 ** 63):
        raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**63), got {seed!r}")


@dataclass(frozen=True)
class RowStats:
    """Speculation statistics of one row.

    A *cycle* is one speculative draft + verify; an *AR step* is one plain decoding step (all of
    them with ``speculative=False``, some with ``"auto"``). Acceptance counts the verifier's verdict
    ``L`` per cycle, before any stop truncates the block.
    """

    num_cycles: int
    num_forward_passes: int          # prefill + 2 per cycle + 1 per AR step
    num_draft_tokens: int            # (k - 1) per cycle of block size k (K unless speculative="auto")
    num_accepted_draft_tokens: int
    accept_length_histogram: list[int] = field(default_factory=list)  # [L] = cycles accepting L drafts
    num_ar_steps: int = 0
    num_tokens_after_stop: int = 0   # decoded after the token completing a stop string (< one block)
    # Of those, the cycles (AR steps) that began in the row's reasoning phase and the drafts they
    # accepted: how well the drafter does on thinking vs answers (``reasoning_tokens_per_cycle``).
    num_reasoning_cycles: int = 0
    num_reasoning_ar_steps: int = 0
    num_reasoning_accepted_draft_tokens: int = 0
    # Drafts the verifier computed (<= num_draft_tokens): a cycle verifies only those its drafter
    # was confident enough in when its verify budget is adaptive (OrthrusEngine(adaptive_verify)).
    num_verified_draft_tokens: int = 0

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens per decode iteration: accepted drafts + 1 per cycle (the acceptance length; TPF is
        half of it), counting an AR step as an iteration of 1 token (1.0 without speculation)."""
        return tokens_per_cycle(self.num_accepted_draft_tokens, self.num_cycles + self.num_ar_steps)

    @property
    def reasoning_tokens_per_cycle(self) -> float:
        """``tokens_per_cycle`` over the iterations that began in the reasoning phase (0.0: none)."""
        return tokens_per_cycle(self.num_reasoning_accepted_draft_tokens,
                                self.num_reasoning_cycles + self.num_reasoning_ar_steps)

    @property
    def answer_tokens_per_cycle(self) -> float:
        """``tokens_per_cycle`` over the iterations after it (0.0: none)."""
        return tokens_per_cycle(self.num_accepted_draft_tokens - self.num_reasoning_accepted_draft_tokens,
                                self.num_cycles + self.num_ar_steps - self.num_reasoning_cycles
                                - self.num_reasoning_ar_steps)

