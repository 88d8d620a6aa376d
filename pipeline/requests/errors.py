"""Error rows: how a row's error message reads, and the one function that decides its finish.

A row that cannot be generated -- bad input, a request the engine refuses, a decode that failed or
timed out, text that cannot be decoded -- is never dropped and never fails its batch: it leaves
the actor with ``finish_reason = "error"`` and its message in the ``error`` column, and the job
goes on (rows in == rows out). Each stage only records a row's message; :func:`finish_columns`,
called once as the actor's rows leave it, decides every row's ``finish_reason`` and ``error``
together, so the two agree by construction.

The format (docs/design.md §6.5): ``<where>: <what>`` or ``<where> <what>`` -- first where the
problem is, in the user's own names (``column 'top_p'``, ``sampling_params.top_k``, ``body.max_tokens``,
``line 7 of batch.jsonl: ...``, ``prompt``, ``messages[0]``) or the stage that failed
(``tokenization failed``, ``invalid request``, ``decoding failed``, ``row timeout``,
``detokenization failed``) -- then what is wrong; an exception's cause follows as
``: <ExceptionType>: <message>`` (:func:`row_error`). At most :data:`MAX_ERROR_CHARS` characters.
"""
from __future__ import annotations

import re

MAX_ERROR_CHARS = 500   # a cell's text can be huge (a whole prompt in an exception); the cause is at the start
ERROR = "error"         # the column; null unless finish_reason == "error"


# The format, checkable: where -- an input file's line (``line 7 of batch.jsonl: ``), a column, a
# request key path, a prompt field, or the stage that failed -- then a space or a colon. Tests hold
# every error row to it.
FORMAT = re.compile(
    r"^(line \d+ of [^:]+: "
    r"|(column '[^']+'"
    r"|(sampling_params|sampling|body|structured|messages|prompt|custom_id|method|url|tokenized_prompt)([.\[][\w\[\].]*)?"
    r"|tokenization failed|invalid request|decoding failed|row timeout|detokenization failed|not generated"
    r"|not decoded|chat template failed|formatting the prompt failed)[ :])")


class RowError(ValueError):
    """A problem with one row: it becomes an error row, the job goes on."""


def finish_columns(reasons: list[str | None], errors: list[str | None]) -> tuple[list[str], list[str | None]]:
    """Every row's ``finish_reason`` and ``error``: a row with an error ends ``"error"`` with it (cut to
    :data:`MAX_ERROR_CHARS`); a row with neither a finish reason nor an error is an error row
    ("not decoded"); any other row keeps its finish reason and has no error."""
    out_reasons: list[str] = []
    out_errors: list[str | None] = []
    for reason, error in zip(reasons, errors):
        if error is None and reason in (None, "error"):
            error = row_error("not decoded")
        out_reasons.append("error" if error is not None else reason)
        out_errors.append(None if error is None else error[:MAX_ERROR_CHARS])
    return out_reasons, out_errors


def row_error(what: str, cause: BaseException | str | None = None) -> str:
    """The error message of one row: ``what``, then the cause (an exception names its type)."""
    if cause is None:
        text = what
    elif isinstance(cause, BaseException):
        text = f"{what}: {type(cause).__name__}: {cause}"
    else:
        text = f"{what}: {cause}"
    return text[:MAX_ERROR_CHARS]
