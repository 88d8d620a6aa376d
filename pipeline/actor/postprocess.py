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

from orthrus import ReasoningTokens
from pipeline import schema as S
from pipeline.requests.errors import ERROR, finish_columns, row_error


def detokenize_batch(batch: pa.Table, tokenizer, reasoning: ReasoningTokens | None = None) -> pa.Table:
    """Add ``generated_text`` (the engine's stop-string text, else the decoded ids; null without a
    tokenizer, i.e. ``detokenize=False``) and, for rows with a reasoning phase, ``reasoning`` (the
    think block's text, split off ``generated_text``: :func:`split_reasoning`); decide each row's
    ``finish_reason`` and ``error`` (``errors.finish_columns``); drop the internal columns."""
    text_ids = batch[S.TEXT_IDS].to_pylist()
    stop_text = batch[S.STOP_TEXT].to_pylist()
    reasons = batch["finish_reason"].to_pylist()
    errors = batch[ERROR].to_pylist()
    completions: list[str | None] = [None] * len(text_ids)
    todo: list[int] = []                   # rows whose text is decoded from their ids
    for i, (reason, stop) in enumerate(zip(reasons, stop_text)):
        if reason is None or errors[i] is not None or tokenizer is None:
            continue
        if stop is not None:
            completions[i] = stop
        else:
            todo.append(i)
    for i, text in zip(todo, _decode_all(tokenizer, [text_ids[i] for i in todo])):
        if isinstance(text, Exception):   # a row that cannot be decoded is an error row
            errors[i] = row_error("detokenization failed", text)
        else:
            completions[i] = text
    thinking = batch["num_reasoning_tokens"].to_pylist() if "num_reasoning_tokens" in batch.column_names \
        else [None] * batch.num_rows
    decoded = set(todo)
    thoughts = split_reasoning(completions, [ids if i in decoded else None for i, ids in enumerate(text_ids)],
                               thinking, reasoning, tokenizer)
    reasons, errors = finish_columns(reasons, errors)     # the one decision: they agree by construction
    table = batch.drop_columns([S.TEXT_IDS, S.STOP_TEXT, "finish_reason", ERROR])
    for name, typ, values in (("generated_text", pa.string(), completions), ("reasoning", pa.string(), thoughts),
                              ("finish_reason", pa.string(), reasons), (ERROR, pa.string(), errors)):
        table = table.append_column(pa.field(name, typ), pa.array(values, typ))
    return table


def _decode_all(tokenizer, seqs: list[list[int]]) -> list[str | Exception]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` of each sequence (or the exception it
    raised). When the tokenizer cleans up no spaces, ``decode`` is its Rust tokenizer's ``decode``
    behind a conversion that walks every id in Python; calling that directly costs a fraction at a
    few tokens per row. (Not ``decode_batch``: it fans out to a thread pool, which a 1-CPU actor
    whose engine thread is busy pays for.)"""
    direct = not getattr(tokenizer, "clean_up_tokenization_spaces", True) and hasattr(tokenizer, "backend_tokenizer")
    decode = (lambda ids: tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)) if direct else \
        (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    out: list[str | Exception] = []
    for ids in seqs:
        try:
            out.append(decode(ids))
        except Exception as e:  # noqa: BLE001 - this row's ids are the problem
            out.append(e)
    return out



def split_reasoning(completions: list[str | None], ids: list[list[int] | None], reasoning_tokens: list[int | None],
                    tokens: ReasoningTokens | None, tokenizer) -> list[str | None]:
    """Split each reasoning row's text (``reasoning_tokens`` not null) at its think end, in place:
    ``completions[i]`` keeps the answer after it (the template's newlines before it dropped), the
    returned ``reasoning[i]`` the think block's text without its tags (all of it when the block never
    closed; the answer is then empty). By token ids where the text was decoded from them (``ids[i]``),
    by text where it is the engine's stop-string cut. Bounded by the batch's rows."""
    out: list[str | None] = [None] * len(completions)
    if tokens is None or tokenizer is None:
        return out
    tags = (tokens.start, tokens.end)
    for i, (text, n) in enumerate(zip(completions, reasoning_tokens)):
        if n is None or text is None:
            continue
        if ids[i] is not None:
            thought, answer = ids[i][:n], ids[i][n:]
            out[i] = tokenizer.decode([t for t in thought if t not in tags], skip_special_tokens=True).strip()
            completions[i] = tokenizer.decode(answer, skip_special_tokens=True).lstrip("\n")
            continue
        start, end = (tokenizer.decode([t]) for t in tags)
        thought, closed, answer = text.partition(end)
        out[i] = thought.replace(start, "", 1).strip()
        completions[i] = answer.lstrip("\n") if closed else ""
    return out
