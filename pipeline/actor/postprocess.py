"""After generation: detokenize (runs in the generation actor).

Decoding text costs microseconds per token, so it runs right after the engine in the same actor:
a separate Ray stage would add a pool of CPU workers, an object-store round trip of the token ids
and per-block scheduling delay before each batch can be committed.

Stop strings are applied inside the engine (``orthrus/stop_strings.py``): a row ends in the
iteration its stop string appears, its token ids end right before it, and the engine hands back
the completion text cut exactly before the stop string (``STOP_TEXT``), which is used as is.
"""
from __future__ import annotations

import pyarrow as pa

from pipeline.rows import schema as S
from pipeline.rows.errors import ERROR, row_error


def detokenize_batch(batch: pa.Table, tokenizer) -> pa.Table:
    """Add ``generated_text`` (the engine's stop-string text, else the decoded ids; null without a
    tokenizer, i.e. ``detokenize=False``); drop the internal columns."""
    text_ids = batch[S.TEXT_IDS].to_pylist()
    stop_text = batch[S.STOP_TEXT].to_pylist()
    reasons = batch["finish_reason"].to_pylist()
    errors = batch[ERROR].to_pylist()
    completions: list[str | None] = []
    for i, ids in enumerate(text_ids):
        if reasons[i] == "error" or tokenizer is None:
            completions.append(None)
        elif stop_text[i] is not None:
            completions.append(stop_text[i])
        else:
            try:
                completions.append(tokenizer.decode(ids, skip_special_tokens=True))
            except Exception as e:  # noqa: BLE001 - a row that cannot be decoded is an error row
                completions.append(None)
                reasons[i], errors[i] = "error", row_error("detokenization failed", e)
    table = batch.drop_columns([S.TEXT_IDS, S.STOP_TEXT, "finish_reason", ERROR])
    for name, typ, values in (("generated_text", pa.string(), completions), ("finish_reason", pa.string(), reasons),
                              (ERROR, pa.string(), errors)):
        table = table.append_column(pa.field(name, typ), pa.array(values, typ))
    return table
