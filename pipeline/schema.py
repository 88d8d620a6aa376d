"""Column names and Arrow types: the output contract, and the internal columns between stages.

Every output part file has exactly :func:`output_schema` (fixed columns, then the input's
pass-through columns), so the output directory reads as one table whatever each batch held.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

# One of the k most likely tokens at a generated position (``top_logprobs``).
TOP_LOGPROB = pa.struct([pa.field("id", pa.int32()), pa.field("logprob", pa.float32())])

# The output contract (issue: "Output columns"), in file order.
OUTPUT_FIELDS: tuple[pa.Field, ...] = (
    pa.field("id", pa.string()),
    pa.field("sample_index", pa.int64()),
    pa.field("completion", pa.string()),             # a reasoning row's answer only (after its think end)
    pa.field("reasoning", pa.string()),              # its think block's text; null without a reasoning phase
    pa.field("finish_reason", pa.string()),          # "stop" | "length" | "error"
    pa.field("error", pa.string()),                  # null unless finish_reason == "error"
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_completion_tokens", pa.int64()),
    pa.field("num_reasoning_tokens", pa.int64()),    # of those, up to and including the think end
    pa.field("num_cycles", pa.int64()),
    pa.field("num_forward_passes", pa.int64()),
    pa.field("num_draft_tokens", pa.int64()),
    pa.field("num_accepted_draft_tokens", pa.int64()),
    pa.field("num_verified_draft_tokens", pa.int64()),    # of the drafts, those the verifier computed
    pa.field("tokens_per_cycle", pa.float64()),
    pa.field("accept_length_histogram", pa.list_(pa.int64())),
    pa.field("num_tokens_after_stop", pa.int64()),   # decoded past a stop string, not in the completion
    pa.field("num_reasoning_cycles", pa.int64()),    # of the cycles, those begun while thinking
    pa.field("num_reasoning_accepted_draft_tokens", pa.int64()),   # and the drafts they accepted
    pa.field("token_logprobs", pa.list_(pa.float32())),            # null unless the row asked for logprobs
    pa.field("generated_token_ids", pa.list_(pa.int32())),         # null unless the row asked for logprobs
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),     # null unless logprobs > 0
    pa.field("cumulative_logprob", pa.float64()),                  # sum of token_logprobs
    pa.field("time_waiting_s", pa.float64()),        # in the engine's queue, waiting for a slot
    pa.field("time_in_engine_s", pa.float64()),      # from admission into a slot to the row's end
    pa.field("batch_wall_seconds", pa.float64()),    # wall time of the row's whole batch in the actor
    pa.field("audit_match", pa.bool_()),             # null unless audited: equal to plain AR decoding
    pa.field("audit_first_divergence", pa.int64()),  # null unless an audited row diverged
    pa.field("seed", pa.int64()),
    pa.field("model", pa.string()),
)
OUTPUT_NAMES: tuple[str, ...] = tuple(f.name for f in OUTPUT_FIELDS)

# The processor's output columns (``pipeline/processor``, Ray Data LLM's names first). The job's
# output holds the same values, three of them under its own names (JOB_NAMES: job -> processor).
GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("generated_text", pa.string()),
    pa.field("generated_tokens", pa.list_(pa.int32())),   # a final stop token included
    pa.field("num_input_tokens", pa.int64()),
    pa.field("num_generated_tokens", pa.int64()),
    *(f for f in OUTPUT_FIELDS if f.name not in ("id", "sample_index", "completion", "num_prompt_tokens",
                                                 "num_completion_tokens", "generated_token_ids")),
)
JOB_NAMES = {"completion": "generated_text", "num_prompt_tokens": "num_input_tokens",
             "num_completion_tokens": "num_generated_tokens"}
# Columns the processor reads (any other column passes through it).
PROCESSOR_INPUTS = ("prompt", "messages", "tokenized_prompt", "sampling_params")
KEY_COLUMNS = ("id", "sample_index")  # one output row per key, exactly once

# Internal columns carried between stages; the "__" prefix keeps them apart from user columns.
INTERNAL_PREFIX = "__"
FILE = "__file"                        # read -> driver: index of the row's input file in the plan
ROW = "__row"                          # read -> driver: the row's index in that file
SAMPLES = "__samples"                  # read -> preprocess: the row's pending sample indices
DERIVED_ID = "__derived_id"            # read -> preprocess: '<file name>:<row index>' (no id column)
TEXT_IDS = "__text_token_ids"          # engine -> detokenize (ids minus a trailing stop token)
ENGINE_TEXT = "__engine_text"          # engine -> detokenize (RequestOutput.text, when usable as is)
BATCH = "__batch"                      # generate -> driver: one record per batch, on its first row (actor/records.py)
STARTUP = "__startup"                  # read -> preprocess -> generate: when a block was read and prepared
                                       # (STARTUP_TIMES on its first row; the actor moves it into its batch record)

# The input side's moments (``time.time()``) for the job's start-up split (``report/startup.py``).
STARTUP_TIMES = pa.struct([pa.field(name, pa.float64())
                           for name in ("read_start", "read_end", "prepare_start", "prepare_end")])

FINISH_REASONS = ("stop", "length", "error")
GENERATED_TYPES = {**{f.name: f.type for f in GENERATED_FIELDS}, TEXT_IDS: pa.list_(pa.int32()), ENGINE_TEXT: pa.string()}


def output_schema(passthrough: pa.Schema | list[pa.Field]) -> pa.Schema:
    """The fixed output columns followed by the input's pass-through columns."""
    return pa.schema(list(OUTPUT_FIELDS) + list(passthrough))


def _output_column(batch: pa.Table, field: pa.Field) -> pa.ChunkedArray | pa.Array:
    if field.name == "generated_token_ids":     # kept only where logprobs name the tokens (exports)
        if "token_logprobs" not in batch.column_names:
            return pa.nulls(batch.num_rows, field.type)
        return pc.if_else(pc.is_valid(batch["token_logprobs"]), batch["generated_tokens"],
                          pa.scalar(None, batch["generated_tokens"].type))
    name = JOB_NAMES.get(field.name, field.name)
    return batch[name] if name in batch.column_names else pa.nulls(batch.num_rows, field.type)


def to_output_table(batch: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select, rename and cast a processor batch to the job's output schema (drops internal columns)."""
    return pa.table({f.name: _output_column(batch, f) for f in schema}).cast(schema)


def key_strings(ids: pa.Array | pa.ChunkedArray, sample_index: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string per (id, sample_index): the exactly-once key, comparable with ``pc.is_in``."""
    return pc.binary_join_element_wise(pc.cast(ids, pa.string()), pc.cast(sample_index, pa.string()), "\x1f")
