"""After generation: detokenize and apply stop strings (runs in the generation actor).

Decoding text costs microseconds per token, so it runs right after the engine in the same actor:
a separate Ray stage would add a pool of CPU workers, an object-store round trip of the token ids
and per-block scheduling delay before each batch can be committed.

The engine stops on token ids only; stop strings are applied here, after decoding. A completion cut
at a stop string has ``finish_reason = "stop"`` and counts only the tokens up to the one that
completed the stop string; the speculation statistics still describe all decoding done for the row.
"""
from __future__ import annotations

import pyarrow as pa

from pipeline import schema as S


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Character offset of the earliest stop string in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def finish_text(tokenizer, ids: list[int], num_tokens: int, reason: str,
                stops: tuple[str, ...]) -> tuple[str, int, str]:
    """(completion, num_completion_tokens, finish_reason) after detokenizing and stop strings."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = _first_stop(text, stops) if stops else None
    if cut is None:
        return text, num_tokens, reason
    # Smallest token prefix whose text already holds a stop string (containment grows with k).
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop(tokenizer.decode(ids[:mid], skip_special_tokens=True), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    return text[:cut], lo, "stop"


def detokenize_batch(batch: pa.Table, tokenizer, stops: tuple[str, ...]) -> pa.Table:
    """Add ``completion``; update ``num_completion_tokens``/``finish_reason``; drop the token ids."""
    text_ids = batch[S.TEXT_IDS].to_pylist()
    reasons = batch["finish_reason"].to_pylist()
    counts = batch["num_completion_tokens"].to_pylist()
    errors = batch["error"].to_pylist()
    completions: list[str | None] = []
    for i, ids in enumerate(text_ids):
        if reasons[i] == "error":
            completions.append(None)
            continue
        try:
            text, counts[i], reasons[i] = finish_text(tokenizer, ids, counts[i], reasons[i], stops)
            completions.append(text)
        except Exception as e:  # noqa: BLE001 - a row that cannot be decoded is an error row
            completions.append(None)
            reasons[i], errors[i] = "error", f"detokenization failed: {type(e).__name__}: {e}"
    table = batch.drop_columns([S.TEXT_IDS, "finish_reason", "num_completion_tokens", "error"])
    for name, typ, values in (("completion", pa.string(), completions), ("finish_reason", pa.string(), reasons),
                              ("num_completion_tokens", pa.int64(), counts), ("error", pa.string(), errors)):
        table = table.append_column(pa.field(name, typ), pa.array(values, typ))
    return table
