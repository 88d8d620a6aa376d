"""Engine results → the batch's generation columns, in one pass over the rows.

Each finished row is a ``RequestOutput`` (a Python object), so one pass per row is the floor: this
reads each row's fields once, as one tuple, and transposes them into columns, instead of one list
comprehension (and one attribute walk) per column. At a token or a few per row (labelling and
scoring jobs) this pass weighs as much as the decoding, so it counts.
"""
from __future__ import annotations

from orthrus import RequestOutput, SamplingParams
from pipeline import schema as S
from pipeline.requests.errors import ERROR

# The columns filled from a RequestOutput, in the order of the tuple ``_row`` returns.
_COLUMNS = ("generated_tokens", "num_generated_tokens", "finish_reason", "num_cycles", "num_forward_passes",
            "num_draft_tokens", "num_accepted_draft_tokens", "tokens_per_cycle", "accept_length_histogram",
            "num_tokens_after_stop", "token_logprobs", "top_logprobs", "cumulative_logprob", "time_waiting_s",
            "time_in_engine_s", "num_reasoning_tokens", "num_reasoning_cycles", "num_reasoning_accepted_draft_tokens",
            "num_verified_draft_tokens", S.TEXT_IDS, S.ENGINE_TEXT)
_ERROR_ROW = (None,) * len(_COLUMNS)        # finish_reason and error: ``errors.finish_columns``


def result_columns(ok: list[RequestOutput | None], errors: list[str | None], params: list[SamplingParams | None],
                   eos_ids: frozenset[int]) -> dict[str, list]:
    """Per-row values of what the engine returned (None for rows without a result), and ``errors``
    as the ``error`` column; ``postprocess.detokenize_batch`` decides the rows' finish (``finish_columns``)."""
    rows = [_row(r, p, eos_ids) if r is not None else _ERROR_ROW for r, p in zip(ok, params)]
    cols = dict(zip(_COLUMNS, map(list, zip(*rows)))) if rows else {name: [] for name in _COLUMNS}
    cols[ERROR] = [None if r is not None else e for r, e in zip(ok, errors)]
    return cols


def _row(r: RequestOutput, p: SamplingParams, eos_ids: frozenset[int]) -> tuple:
    s, ids = r.stats, r.token_ids
    return (ids, len(ids), r.finish_reason, s.num_cycles, s.num_forward_passes, s.num_draft_tokens,
            s.num_accepted_draft_tokens, float(s.tokens_per_cycle), s.accept_length_histogram,
            s.num_tokens_after_stop, r.token_logprobs, _top(r), r.cumulative_logprob, r.queue_seconds,
            r.engine_seconds, r.num_reasoning_tokens, *_thinking(r), s.num_verified_draft_tokens,
            _text_ids(r, p, eos_ids), _text(r))


def _text(r: RequestOutput) -> str | None:
    """The engine's decoded text, used as the row's text (no second detokenization), except for a
    reasoning row that no stop string cut: its thought and answer are decoded apart, split at the
    think end's position in the ids (a split of the text would miss a think end decoded as nothing)."""
    if r.num_reasoning_tokens is not None and not isinstance(r.stop_reason, str):
        return None
    return r.text


def _thinking(r: RequestOutput) -> tuple[int | None, int | None]:
    """A reasoning row's cycles begun while thinking and the drafts they accepted (None: no phase)."""
    if r.num_reasoning_tokens is None:
        return None, None
    return r.stats.num_reasoning_cycles, r.stats.num_reasoning_accepted_draft_tokens


def _text_ids(r: RequestOutput, p: SamplingParams, eos_ids: frozenset[int]) -> list[int]:
    """Generated ids minus the stop token that ended the row (it is not part of the text)."""
    ids = r.token_ids
    if r.finish_reason == "stop" and ids and (ids[-1] in eos_ids or ids[-1] in p.stop_token_ids):
        return ids[:-1]
    return ids


def _top(r: RequestOutput) -> list | None:
    if r.top_logprobs is None:
        return None
    return [[{"id": i, "logprob": v} for i, v in position] for position in r.top_logprobs]
