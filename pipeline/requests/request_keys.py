"""One rule for request keys this job does not implement, for every source of requests: the
processor's ``sampling_params`` (vLLM's names) and OpenAI batch ``body`` objects.

- a key this job uses is used;
- a key in :data:`IGNORED` (bookkeeping that changes no token: ``model``, ``user``, ``metadata`` ...)
  is accepted and ignored;
- a key in :data:`DEFAULTS` (a generation option of vLLM or OpenAI this job does not implement)
  is accepted only at its default value, which asks for nothing, and ignored;
- any other key with a non-null value, and a :data:`DEFAULTS` key with another value, is that
  row's error naming the user's key (``body.frequency_penalty: not supported``): a silently
  ignored option would give the row a completion it did not ask for.

The job's input columns follow the same rule for the options in :data:`JOB_COLUMNS` (a column
``best_of`` at 2 is that row's error; at 1 it passes through). Every other column passes
through to the output as before: a job's input has columns of its own (``n``, ``name``, ``model``)
that are data, not requests.
"""
from __future__ import annotations

from typing import Any, Iterable

from pipeline.requests.errors import RowError

IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream", "stream_options",
                     "request_id", "priority", "name"})
# The default of each option we do not implement: the value that asks for nothing beyond plain generation.
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "n": (1,),
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "functions": ([],),
    "function_call": ("none", "auto"), "echo": (False,), "suffix": ("",),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "detokenize": (True,),
    "include_stop_str_in_output": (False,), "prompt_logprobs": (0,), "truncate_prompt_tokens": (0,),
    "reasoning_effort": ("",), "modalities": (["text"],), "audio": ({},), "prediction": ({},),
    "web_search_options": ({},),
}


JOB_COLUMNS = ("best_of",)


def unsupported(key: str, value: Any) -> str | None:
    """Why a job input column's value asks for something this job does not do (None: it does not)."""
    if key not in JOB_COLUMNS or value is None or _is_default(key, value):
        return None
    return f"not supported (got {value!r})"[:200]


def _is_default(key: str, value: Any) -> bool:
    return any(value == d and type(value) is not bool or value is d for d in DEFAULTS.get(key, ()))


def check_keys(obj: dict[str, Any], supported: Iterable[str], prefix: str) -> None:
    """Raise :class:`RowError` naming ``<prefix>.<key>`` for the first key of ``obj`` that asks for
    something this job does not do (null values ask for nothing)."""
    used = set(supported)
    for key, value in obj.items():
        if value is None or key in used or key in IGNORED or _is_default(key, value):
            continue
        why = "not supported" if key in DEFAULTS else "not a field this job knows"
        raise RowError(f"{prefix}.{key}: {why} (got {value!r})"[:300])
