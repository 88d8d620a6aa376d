"""An unexpected failure of the job: one paragraph for the user, the whole traceback in a file.

A Ray Data failure arrives as a chain of wrappers (``RayTaskError``, ``UserCodeException``, ...)
around the exception that actually happened in a task; the paragraph names that innermost one, and
the full chain goes to ``<output>/_logs/crash-<time>.log`` (the system temp directory when the
output directory cannot be written).
"""
from __future__ import annotations

import re
import tempfile
import time
import traceback
from pathlib import Path

from pipeline.exceptions import exception_chain, is_ray_wrapper

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.*)$", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def root_cause(exc: BaseException) -> tuple[str, str]:
    """(type name, first line of the message) of the exception that actually happened.

    The innermost exception that is not one of Ray's wrappers; when Ray wrapped only text (an actor
    that died in its constructor carries the remote traceback in its message), the last exception
    line of that text.
    """
    chain = exception_chain(exc)
    for e in reversed(chain):
        if not is_ray_wrapper(e):
            return type(e).__name__, (str(e).strip().splitlines() or [""])[0][:500]
    for e in chain:
        found = _EXC_LINE.findall(_ANSI.sub("", str(e)))
        if found:
            name, message = found[-1]
            return name.rsplit(".", 1)[-1], message[:500]
    return type(exc).__name__, (str(exc).strip().splitlines() or [""])[0][:500]


def _write_log(exc: BaseException, output) -> str:
    text = "".join(traceback.format_exception(exc))
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if output is not None:
        try:
            return output.write_log(name, text)    # <output>/_logs/, local or on the object store
        except OSError:
            pass
    try:
        (Path(tempfile.gettempdir()) / name).write_text(text)
        return str(Path(tempfile.gettempdir()) / name)
    except OSError:
        return "<not written>"


def crash_message(exc: BaseException, output) -> str:
    """Write the traceback to ``<output>/_logs/`` (``output``: the job's output directory, or None; the
    temp directory if that fails) and return the paragraph to print (exit status 4)."""
    name, first = root_cause(exc)
    log = _write_log(exc, output)
    return (f"error: the job crashed: {name}: {first}. This is a bug or an environment "
            f"problem, not a problem of one row (those become error rows). The parts committed so far are "
            f"complete; once the cause is fixed, rerun with --resume. Full traceback: {log}")


def refusal_message(exc: BaseException, output) -> str:
    """The message of a refusal (a :class:`ConfigError`), wherever it was found. Raised inside a Ray
    task it can arrive in Ray's wrapper, whose message is the remote traceback: then it is one
    line, the task's own message, and the traceback goes to ``<output>/_logs/`` (named at the end)."""
    if not is_ray_wrapper(exc):
        return getattr(exc, "message", None) or str(exc)     # ours: as written (may list several fields)
    inner = next((e for e in reversed(exception_chain(exc)) if not is_ray_wrapper(e)), exc)
    text = getattr(inner, "message", None) or str(inner)
    line = (text.strip().splitlines() or [""])[0]
    return f"{line} (traceback: {_write_log(exc, output)})"
