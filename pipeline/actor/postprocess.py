"""After generation: detokenize (runs in the generation actor).

Decoding text costs microseconds per token, so it runs right after the engine in the same actor:
a separate Ray stage would add a pool of CPU workers, an object-store round trip of the token ids
and per-block scheduling delay before each batch can be committed.

The engine decodes each finished row once (``RequestOutput.text``; ``ENGINE_TEXT``) and that text is
used as is; only a row it did not decode (ids it cannot decode, or a reasoning row's two parts) is
decoded here. Stop strings are applied inside the engine (``orthrus/engine/host/stop_strings.py``):
a row ends in the iteration its stop string appears, its token ids end right before it, and its
text is cut exactly before the stop string.
"""
from __future__ import annotations

import pyarrow as pa

from orthrus import ReasoningTokens
from pipeline import schema as S
from pipeline.requests.errors import ERROR, finish_columns, row_error


def detokenize_batch(batch: pa.Table, tokenizer, reasoning: ReasoningTokens | None = None) -> pa.Table:
    """Add ``generated_text`` (the engine's text, else the decoded ids; null without a
    tokenizer, i.e. ``detokenize=False``) and ``reasoning`` (:func:`_split`: a reasoning row's think
    block, apart from its answer); decide each row's ``finish_reason`` and ``error``
    (``errors.finish_columns``); drop the internal columns."""
    text_ids = batch[S.TEXT_IDS].to_pylist()
    engine_text = batch[S.ENGINE_TEXT].to_pylist()
    reasons = batch["finish_reason"].to_pylist()
    errors = batch[ERROR].to_pylist()
    thinking = batch["num_reasoning_tokens"].to_pylist() \
        if reasoning is not None and "num_reasoning_tokens" in batch.column_names else [None] * batch.num_rows
    completions: list[str | None] = [None] * len(text_ids)
    thoughts: list[str | None] = [None] * len(text_ids)
    todo: list[int] = []                   # rows whose text is decoded from their ids
    for i, (reason, text) in enumerate(zip(reasons, engine_text)):
        if reason is None or errors[i] is not None or tokenizer is None:
            continue
        if text is None:
            todo.append(i)
        elif thinking[i] is None:
            completions[i] = text
        else:                              # a stop string's cut text: split at the think end's text
            thoughts[i], completions[i] = _split_text(text, reasoning, tokenizer)
    _decode_rows(tokenizer, todo, text_ids, thinking, reasoning, (completions, thoughts, errors))
    reasons, errors = finish_columns(reasons, errors)     # the one decision: they agree by construction
    table = batch.drop_columns([S.TEXT_IDS, S.ENGINE_TEXT, "finish_reason", ERROR])
    for name, values in (("generated_text", completions), ("reasoning", thoughts), ("finish_reason", reasons),
                         (ERROR, errors)):
        table = table.append_column(pa.field(name, S.TYPES[name]), pa.array(values, S.TYPES[name]))
    return table


def _decode_rows(tokenizer, todo: list[int], text_ids: list, thinking: list[int | None],
                 reasoning: ReasoningTokens | None, out: tuple[list, list, list]) -> None:
    """Decode the ``todo`` rows' ids into ``out`` (completions, thoughts, errors), each token once: a
    reasoning row (``thinking[i]`` tokens of thought) as its answer after the think end (the
    template's newlines before it dropped) and its thought without the think tags. Bounded by the batch."""
    completions, thoughts, errors = out
    answers = [text_ids[i][thinking[i]:] if thinking[i] is not None else text_ids[i] for i in todo]
    for i, text in zip(todo, _decode_all(tokenizer, answers)):
        if isinstance(text, Exception):   # a row that cannot be decoded is an error row
            errors[i] = row_error("detokenization failed", text)
        else:
            completions[i] = text if thinking[i] is None else text.lstrip("\n")
    rows = [i for i in todo if thinking[i] is not None and errors[i] is None]
    if not rows:
        return
    tags = (reasoning.start, reasoning.end)
    for i, text in zip(rows, _decode_all(tokenizer, [[t for t in text_ids[i][:thinking[i]] if t not in tags]
                                                      for i in rows])):
        if isinstance(text, Exception):
            errors[i] = row_error("detokenization failed", text)
        else:
            thoughts[i] = text.strip()


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



def _split_text(text: str, tokens: ReasoningTokens, tokenizer) -> tuple[str, str]:
    """(thought, answer) of a reasoning row's text: the think block without its tags, and what comes
    after the think end (the template's newlines dropped); a block that never closed is all thought."""
    start, end = (tokenizer.decode([t]) for t in (tokens.start, tokens.end))
    thought, closed, answer = text.partition(end)
    return thought.replace(start, "", 1).strip(), answer.lstrip("\n") if closed else ""
