"""The output columns: one table, and every list of output columns derives from it.

Per column: the name it is made under (the processor's, Ray Data LLM's where it has one), its name
in the job's Parquet output, its Arrow type, the stage that fills it, how an engine column is taken
from the row's ``orthrus.RequestOutput``, whether the part footers and ``summary.json`` sum it (or
keep its quantiles), the live Ray counter of it, and what it holds. Derived: the job's Parquet
schema and the processor's columns (``schema.py``), the row builder (``actor/results.py``), the
columns the actor appends (``actor/stage.py``), the footers' sums and sketches (``output/stats.py``;
``summary.json["column_sums"]``) and the actor's counters (``actor/metrics.py``).

A new per-row engine counter is one row here, e.g.
``OutputColumn("num_x", pa.int64(), "engine", "what it counts", take="stats.num_x", stat="sum")``.
The table's order is the job's Parquet column order. A column that outputs already hold keeps its
name, type and place relative to the others (``tests/unit/test_output_columns.py`` holds them to
it: a resumed directory mixes parts of both versions); a new column may go anywhere, since reading
the directory unifies its parts' schemas by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import pyarrow as pa

if TYPE_CHECKING:
    from orthrus import RequestOutput, SamplingParams

# Which stage fills a column: the job's input rows, the prepare step (``requests/prepare.py``), the
# engine (its ``RequestOutput``, by ``take``), the actor itself, its detokenizer
# (``actor/postprocess.py``), or the job's writer (``schema.to_output_table``).
Source = Literal["input", "prepare", "engine", "actor", "text", "job"]
# "sum": summed over the ok rows into each part's footer; "sketch": quantiles kept in the footer.
Stat = Literal["sum", "sketch"]
# A computed engine column: (the row's result, its sampling params, the model's EOS ids) -> value.
Take = Callable[["RequestOutput", "SamplingParams", frozenset], Any]

TEXT_IDS = "__text_token_ids"          # engine -> detokenize (ids minus a trailing stop token)
ENGINE_TEXT = "__engine_text"          # engine -> detokenize (RequestOutput.text, when usable as is)
# One of the k most likely tokens at a generated position (``top_logprobs``).
TOP_LOGPROB = pa.struct([pa.field("id", pa.int32()), pa.field("logprob", pa.float32())])


@dataclass(frozen=True)
class OutputColumn:
    """One output column, under the processor's and the job's names."""

    name: str                     # as the stages make it: the processor's name (the job's for a job-only column)
    arrow: pa.DataType
    source: Source
    doc: str                      # what it holds
    take: str | Take | None = None  # engine columns: an attribute path of RequestOutput, or a function
    job: str | None = ""          # the job's Parquet column ("": ``name``; None: not in the job's output)
    processor: bool = True        # in the processor's output (False: the job's own, or internal)
    stat: Stat | None = None
    metric: str | None = None     # a live Ray counter of its per-batch sums (``actor/metrics.py``)

    def __post_init__(self) -> None:
        if self.job == "":
            object.__setattr__(self, "job", self.name)
        if (self.source == "engine") != (self.take is not None):
            raise ValueError(f"{self.name}: engine columns, and only they, say how they are taken")
        # The footers sum integers exactly and sketch seconds (``output/stats.py``).
        if self.stat == "sum" and not pa.types.is_integer(self.arrow) or \
                self.stat == "sketch" and not pa.types.is_floating(self.arrow):
            raise ValueError(f"{self.name}: a summed column is an integer, a sketched one a float")


def _count(r: RequestOutput, p: SamplingParams, eos: frozenset) -> int:
    return len(r.token_ids)


def _top(r: RequestOutput, p: SamplingParams, eos: frozenset) -> list | None:
    if r.top_logprobs is None:
        return None
    return [[{"id": i, "logprob": v} for i, v in position] for position in r.top_logprobs]


def _in_reasoning(counter: str) -> Take:
    """A reasoning row's ``RowStats`` counter of its thinking phase (None: the row has no such phase)."""
    def take(r: RequestOutput, p: SamplingParams, eos: frozenset) -> int | None:
        return None if r.num_reasoning_tokens is None else getattr(r.stats, counter)
    return take


def _text_ids(r: RequestOutput, p: SamplingParams, eos: frozenset) -> list[int]:
    """Generated ids minus the stop token that ended the row (it is not part of the text)."""
    ids = r.token_ids
    if r.finish_reason == "stop" and ids and (ids[-1] in eos or ids[-1] in p.stop_token_ids):
        return ids[:-1]
    return ids


def _text(r: RequestOutput, p: SamplingParams, eos: frozenset) -> str | None:
    """The engine's decoded text, used as the row's text (no second detokenization), except for a
    reasoning row that no stop string cut: its thought and answer are decoded apart, split at the
    think end's position in the ids (a split of the text would miss a think end decoded as nothing)."""
    if r.num_reasoning_tokens is not None and not isinstance(r.stop_reason, str):
        return None
    return r.text


_C, _I64, _F64, _STR = OutputColumn, pa.int64(), pa.float64(), pa.string()

# In the job's Parquet column order (the module docstring says which rows may move).
COLUMNS: tuple[OutputColumn, ...] = (
    _C("id", _STR, "input", "the input row's id", processor=False),
    _C("sample_index", _I64, "input", "which of the row's n samples", processor=False),
    _C("generated_text", _STR, "text", "the completion; a reasoning row's answer only (after its think end)",
       job="completion"),
    _C("reasoning", _STR, "text", "a reasoning row's think block; null without a reasoning phase"),
    _C("finish_reason", _STR, "engine", '"stop" | "length" | "error"', take="finish_reason"),
    _C("error", _STR, "actor", 'null unless finish_reason == "error"'),
    _C("num_input_tokens", _I64, "prepare", "prompt tokens", job="num_prompt_tokens", stat="sum"),
    _C("num_generated_tokens", _I64, "engine", "tokens generated (a final stop token included)", take=_count,
       job="num_completion_tokens", stat="sum", metric="orthrus_completion_tokens"),
    _C("num_reasoning_tokens", _I64, "engine", "of those, up to and including the think end",
       take="num_reasoning_tokens", stat="sum"),
    _C("num_cycles", _I64, "engine", "speculative cycles run", take="stats.num_cycles", stat="sum",
       metric="orthrus_cycles"),
    _C("num_forward_passes", _I64, "engine", "forward passes (prefill + 2 per cycle + 1 per AR step)",
       take="stats.num_forward_passes", stat="sum"),
    _C("num_draft_tokens", _I64, "engine", "draft tokens proposed", take="stats.num_draft_tokens", stat="sum",
       metric="orthrus_draft_tokens"),
    _C("num_accepted_draft_tokens", _I64, "engine", "draft tokens accepted", take="stats.num_accepted_draft_tokens",
       stat="sum", metric="orthrus_accepted_draft_tokens"),
    _C("num_verified_draft_tokens", _I64, "engine", "of the drafts, those the verifier computed (its budget)",
       take="stats.num_verified_draft_tokens", stat="sum", metric="orthrus_verified_draft_tokens"),
    _C("tokens_per_cycle", _F64, "engine", "accepted drafts + 1 per cycle", take="stats.tokens_per_cycle"),
    _C("accept_length_histogram", pa.list_(_I64), "engine", "[L] = cycles accepting L drafts",
       take="stats.accept_length_histogram"),
    _C("num_tokens_after_stop", _I64, "engine", "decoded past a stop string, not in the completion",
       take="stats.num_tokens_after_stop", stat="sum"),
    _C("num_reasoning_cycles", _I64, "engine", "of the cycles, those begun while thinking",
       take=_in_reasoning("num_reasoning_cycles"), stat="sum"),
    _C("num_reasoning_accepted_draft_tokens", _I64, "engine", "and the drafts they accepted",
       take=_in_reasoning("num_reasoning_accepted_draft_tokens"), stat="sum"),
    _C("token_logprobs", pa.list_(pa.float32()), "engine", "null unless the row asked for logprobs",
       take="token_logprobs"),
    # The job keeps the ids only where logprobs name them (``schema.to_output_table``).
    _C("generated_tokens", pa.list_(pa.int32()), "engine", "generated ids (a final stop token included)",
       take="token_ids", job="generated_token_ids"),
    _C("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB)), "engine", "null unless logprobs > 0", take=_top),
    _C("cumulative_logprob", _F64, "engine", "sum of token_logprobs", take="cumulative_logprob"),
    _C("time_waiting_s", _F64, "engine", "in the engine's queue, waiting for a slot", take="queue_seconds",
       stat="sketch"),
    _C("time_in_engine_s", _F64, "engine", "from admission into a slot to the row's end", take="engine_seconds",
       stat="sketch"),
    _C("batch_wall_seconds", _F64, "actor", "wall time of the row's whole batch in the actor"),
    _C("audit_match", pa.bool_(), "actor", "null unless audited: equal to plain AR decoding"),
    _C("audit_first_divergence", _I64, "actor", "null unless an audited row diverged"),
    _C("seed", _I64, "prepare", "the row's sampling seed"),
    _C("model", _STR, "actor", "the model's path"),
    # Internal: the engine's ids and text for the detokenizer, which drops them.
    _C(TEXT_IDS, pa.list_(pa.int32()), "engine", "ids minus a trailing stop token", take=_text_ids, job=None,
       processor=False),
    _C(ENGINE_TEXT, _STR, "engine", "RequestOutput.text, when usable as is", take=_text, job=None, processor=False),
)

# The columns the engine's results fill (``actor/results.py``), and those the actor appends, in order.
ENGINE: tuple[OutputColumn, ...] = tuple(c for c in COLUMNS if c.source == "engine")
ASSEMBLED: tuple[str, ...] = tuple(c.name for c in COLUMNS if c.source in ("engine", "actor"))
# The part footers' per-column aggregates, under the job's names (``output/stats.py``).
SUMMED: tuple[str, ...] = tuple(c.job for c in COLUMNS if c.stat == "sum" and c.job)
SKETCHED: tuple[str, ...] = tuple(c.job for c in COLUMNS if c.stat == "sketch" and c.job)
# Live counters: the processor's column -> (the Ray metric, its description).
METRICS: dict[str, tuple[str, str]] = {c.name: (c.metric, c.doc) for c in COLUMNS if c.metric}
