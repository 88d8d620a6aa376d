"""The job's sampling defaults (``sampling:``), each overridable per row (``pipeline/requests/sampling_fields.py``)."""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from pipeline.sections import _Section


class SamplingConfig(_Section):
    """Sampling defaults; per-row columns temperature/top_p/top_k/max_new_tokens/min_tokens/max_thinking_tokens/
    seed/logprobs/stop/structured/repetition_penalty/presence_penalty/frequency_penalty/min_p/logit_bias/
    ignore_eos override them (``pipeline/requests/sampling_fields.py``)."""

    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1]; 1 = off.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    max_new_tokens: int = Field(256, ge=1, description="Most tokens generated per sample.")
    min_tokens: int = Field(0, ge=0, description=(
        "Fewest tokens generated per sample (vLLM's min_tokens): no EOS or stop_token_ids token ends a sample "
        "before it has this many (stop strings still do). At most max_new_tokens; cannot be combined with "
        "structured. 0 = off. A row's own 'min_tokens' column wins."))
    max_thinking_tokens: int | None = Field(None, ge=0, description=(
        "Thinking budget of reasoning models (rows whose prompt opens a think block, e.g. Qwen3 with "
        "prompt.enable_thinking): after this many generated tokens without the think end, the think end "
        "(and the template's '\\n\\n' unless the row is structured) is forced and the answer begins. "
        "Exact under speculation. None = unbounded. A row's own 'max_thinking_tokens' column wins."))
    stop: list[str] = Field(default_factory=list, description=(
        "Stop strings: a row ends inside the engine in the iteration the first one appears, and the "
        "completion is cut right before it (finish_reason 'stop')."))
    stop_token_ids: list[int] = Field(default_factory=list, description=(
        "Extra token ids that end a sample (the model's EOS ids always do)."))
    n: int = Field(1, ge=1, description="Samples per prompt (sample_index 0 .. n-1).")
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "None: off. 0: the log-probability of each generated token (token_logprobs, cumulative_logprob). "
        "k > 0: also the k most likely tokens at each position (top_logprobs). Values are the target (AR) "
        "model's log-softmax of its raw logits, as plain AR decoding reports them. A row's own 'logprobs' "
        "column wins."))
    seed: int = Field(0, ge=0, lt=2**63, description=(
        "Base seed: each sample's seed is derived from (seed, id, sample_index), so output does not "
        "depend on batching. A row's own 'seed' column wins (seed + sample_index)."))
    structured: dict[str, Any] | None = Field(None, description=(
        "Structured output for every row: exactly one of {json_schema: {...}} (a JSON value valid under the "
        "schema; the schema may also be its JSON text), {regex: '...'} (the whole completion matches), "
        "{choice: [...]} (exactly one of the strings) or {grammar: '...'} (Lark or GBNF). Only tokens the "
        "constraint allows are sampled, so a row that ends 'stop' is complete and valid ('length': cut by "
        "max_new_tokens). Compiled for the model's tokenizer at preflight, before any model loads. Cannot be "
        "combined with stop or stop_token_ids. A row's own 'structured' column wins (JSON text of the same "
        "{kind: value}, or a struct; the JSON text null: unconstrained). None: off."))

    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description=(
        "vLLM's repetition penalty: a token seen in the prompt or the generated tokens has a positive logit "
        "divided by it and a negative one multiplied. 1 = off. Exact under speculation (each position is "
        "penalised with the tokens before it, drafts included). A row's own column wins."))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "OpenAI's presence penalty: subtracted from the logit of every token already generated. 0 = off."))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "OpenAI's frequency penalty: subtracted from a token's logit once per time it was generated. 0 = off."))
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Drop tokens whose probability (after temperature) is below min_p times the top token's, before "
        "top-k and top-p (vLLM's order). 0 = off."))
    logit_bias: dict[int, float] = Field(default_factory=dict, description=(
        "Token id -> bias in [-100, 100] added to that token's logit before penalties and sampling "
        "(OpenAI's logit_bias; -100 bans a token in effect). A row's own column (a map, or a JSON object) wins."))
    ignore_eos: bool = Field(False, description=(
        "EOS does not end a sample (stop_token_ids and stop strings still do): every sample runs to "
        "max_new_tokens. Cannot be combined with structured."))

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("structured")
    @classmethod
    def _one_constraint(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from orthrus.constraints import parse_constraint   # the shape only: compiling needs the tokenizer

        try:
            parse_constraint(v)
        except ValueError as e:   # the engine's words name SamplingParams; a job's user knows this field
            raise ValueError(str(e).replace("SamplingParams.structured", "structured")) from None
        return v

    @model_validator(mode="after")
    def _structured_without_stops(self) -> "SamplingConfig":
        which = "stop" if self.stop else "stop_token_ids" if self.stop_token_ids else None
        if self.structured is not None and which:
            raise ValueError(f"structured cannot be combined with {which}: a constrained row ends where its "
                             "grammar is complete (a stop could cut it mid-record)")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        if self.min_tokens and self.structured is not None:
            raise ValueError("min_tokens cannot be combined with structured: a complete grammar may allow only EOS, "
                             "which min_tokens forbids")
        if self.ignore_eos and self.structured is not None:
            raise ValueError("ignore_eos cannot be combined with structured: a constrained row ends by EOS where its "
                             "grammar is complete")
        return self
