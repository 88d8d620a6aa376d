"""Walking what an exception wraps: Python's ``__cause__``/``__context__`` and Ray's ``cause``.

A failure inside a Ray task or actor reaches the driver as a chain of wrappers (``RayTaskError``,
``UserCodeException``, ...) around the exception that actually happened. Every place that looks
through such a chain (the crash paragraph, the input-file error, the task helper) walks it here.
"""
from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def ray_cause(exc: BaseException) -> BaseException | None:
    """The exception a Ray wrapper carries in ``cause`` (None: not a wrapper, or it wraps only text)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else None


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and everything it wraps (``__cause__``, ``__context__``, Ray's ``cause``), outermost
    first, each exception once."""
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [x for x in (e.__context__, ray_cause(e), e.__cause__) if x is not None]
    return out


def first_of(exc: BaseException, kind: type[E]) -> E | None:
    """The outermost exception of type ``kind`` on ``exc``'s chain (None: there is none)."""
    return next((e for e in exception_chain(exc) if isinstance(e, kind)), None)


def is_ray_wrapper(exc: BaseException) -> bool:
    """Whether ``exc`` is one of Ray's own exception types (a wrapper, not what happened)."""
    return type(exc).__module__.startswith("ray.")
