"""Column names and Arrow types: the output contract, and the internal columns between stages.

Every output part file has exactly :func:`output_schema` (fixed columns, then the input's
pass-through columns), so the output directory reads as one table whatever each batch held.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

# TEXT_IDS and ENGINE_TEXT (engine -> detokenize) are internal columns of the table; named here too.
from pipeline.columns import COLUMNS, ENGINE_TEXT, TEXT_IDS, TOP_LOGPROB  # noqa: F401

# The output contract, in file order, and the processor's output columns (Ray Data LLM's names):
# both derived from the one table of columns (``columns.py``), as the job's names for the processor's
# columns (JOB_NAMES: job -> processor) and every column's type (TYPES: processor name -> type).
OUTPUT_FIELDS: tuple[pa.Field, ...] = tuple(pa.field(c.job, c.arrow) for c in COLUMNS if c.job is not None)
OUTPUT_NAMES: tuple[str, ...] = tuple(f.name for f in OUTPUT_FIELDS)
GENERATED_FIELDS: tuple[pa.Field, ...] = tuple(pa.field(c.name, c.arrow) for c in COLUMNS if c.processor)
JOB_NAMES = {c.job: c.name for c in COLUMNS if c.job is not None and c.job != c.name}
TYPES: dict[str, pa.DataType] = {c.name: c.arrow for c in COLUMNS}   # the internal TEXT_IDS, ENGINE_TEXT too
# Columns the processor reads (any other column passes through it).
PROCESSOR_INPUTS = ("prompt", "messages", "tokenized_prompt", "sampling_params")
KEY_COLUMNS = ("id", "sample_index")  # one output row per key, exactly once

# Internal columns carried between stages; the "__" prefix keeps them apart from user columns.
INTERNAL_PREFIX = "__"
FILE = "__file"                        # read -> driver: index of the row's input file in the plan
ROW = "__row"                          # read -> driver: the row's index in that file
SAMPLES = "__samples"                  # read -> preprocess: the row's pending sample indices
DERIVED_ID = "__derived_id"            # read -> preprocess: '<file name>:<row index>' (no id column)
BATCH = "__batch"                      # generate -> driver: one record per batch, on its first row (actor/records.py)
STARTUP = "__startup"                  # read -> preprocess -> generate: when a block was read and prepared
                                       # (STARTUP_TIMES on its first row; the actor moves it into its batch record)

# The input side's moments (``time.time()``) for the job's start-up split (``report/startup.py``).
STARTUP_TIMES = pa.struct([pa.field(name, pa.float64())
                           for name in ("read_start", "read_end", "prepare_start", "prepare_end")])

FINISH_REASONS = ("stop", "length", "error")


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
