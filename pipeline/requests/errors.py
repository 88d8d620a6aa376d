"""Error rows: the one place a row's error message is made.

A row that cannot be generated -- bad input, a request the engine refuses, a decode that failed or
timed out, text that cannot be decoded -- is never dropped and never fails its batch: it leaves
the actor with ``finish_reason = "error"`` and this message in the ``error`` column, and the job
goes on (rows in == rows out). Every stage builds that message here, so they all read alike:
``"<what went wrong>: <ExceptionType>: <detail>"``, cut to :data:`MAX_ERROR_CHARS`.
"""
from __future__ import annotations

MAX_ERROR_CHARS = 500   # a cell's text can be huge (a whole prompt in an exception); the cause is at the start
ERROR = "error"         # the column; null unless finish_reason == "error"


class RowError(ValueError):
    """A problem with one row: it becomes an error row, the job goes on."""


def row_error(what: str, cause: BaseException | str | None = None) -> str:
    """The error message of one row: ``what``, then the cause (an exception names its type)."""
    if cause is None:
        text = what
    elif isinstance(cause, BaseException):
        text = f"{what}: {type(cause).__name__}: {cause}"
    else:
        text = f"{what}: {cause}"
    return text[:MAX_ERROR_CHARS]
