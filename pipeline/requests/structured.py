"""Structured output on rows: every way a row can ask for a constraint, as the engine's ``Constraint``.

The engine takes ``SamplingParams(structured={kind: value})`` (``orthrus/constraints.py``). Rows
ask for it in the names their users already know, each error naming the field it came from:

- the job: ``sampling.structured`` (every row; compiled at preflight) and the input column
  ``structured`` (JSON text of ``{kind: value}``, or a struct/map; the text ``null`` turns the job's
  constraint off for that row);
- OpenAI batch bodies: ``response_format`` and vLLM's ``guided_json``/``guided_regex``/
  ``guided_choice``/``guided_grammar`` (:func:`from_openai_body`, at staging);
- the processor's ``sampling_params``: ``structured``, vLLM's ``guided_decoding`` (or its newer name
  ``structured_outputs``) and the flat ``guided_*`` keys (:func:`from_sampling_params`).

:func:`compile_error` compiles a row's constraint for the tokenizer in the CPU prepare stage, once
per distinct constraint per process, so a schema, pattern or grammar that does not compile is that
row's error naming its field before the row reaches an actor (the actor's ``check_request`` stays
the backstop).
"""
from __future__ import annotations

import functools
import json
from typing import Any

from orthrus import Constraint, ConstraintError
from orthrus.constraints import parse_constraint
from pipeline.requests.errors import RowError

STRUCTURED = "structured"               # the job's input column and the sampling_params key
# Staged OpenAI rows: the constraint the body asks for (JSON text, as a ``structured`` cell) and the
# body field it came from (its errors name it). Internal columns, consumed by the preprocessing,
# which hands each row's field on to the prepare stage in STRUCTURED_FIELD.
STAGED_STRUCTURED = "__structured"
STRUCTURED_FIELD = "__structured_field"
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
GUIDED_KEYS = tuple(f"guided_{k}" for k in VLLM_KINDS)          # vLLM's flat extra keys
NESTED_KEYS = ("guided_decoding", "structured_outputs")          # vLLM's object (old name, new name)
SAMPLING_PARAMS_KEYS = (STRUCTURED, *NESTED_KEYS, *GUIDED_KEYS)
_IGNORED_NESTED = ("backend",)        # one backend here: a vLLM user's choice of one is moot


class Off:
    """A row that explicitly asks for no constraint (the text ``null``, OpenAI's ``{"type": "text"}``),
    overriding the job's ``sampling.structured``."""

    def __repr__(self) -> str:
        return "OFF"


OFF = Off()


def constraint_json(c: Constraint | Off | None) -> str | None:
    """A constraint as JSON text of ``{kind: value}`` (the request and staged columns); ``null`` for OFF."""
    if c is None:
        return None
    if isinstance(c, Off):
        return "null"
    if c.kind in ("json_schema", "choice"):      # the spec is already canonical JSON
        return '{"%s": %s}' % (c.kind, c.spec)
    return json.dumps({c.kind: c.spec}, ensure_ascii=False)


def _pruned(value: Any) -> Any:
    """A value read back from an Arrow struct without the null fields the struct type added: a
    struct column holds every field any of its rows has, so row A's schema comes back with row B's
    keys set to null. (JSON text is read exactly; it is the form to use for null-valued keywords.)"""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _as_object(value: Any, where: str) -> Any:
    """A cell as a Python value: JSON text parsed, a struct pruned, a map (key/value pairs) a dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"{where} is not valid JSON: {e}") from None
        if isinstance(value, str):   # a JSONL key holding both text and objects is staged as each
            try:                     # value's JSON text, so text that was JSON already is encoded twice
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RowError(f"{where} is not valid JSON: {e}") from None
        return value
    if isinstance(value, list) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    return _pruned(value)


def parse_spec(spec: dict[str, Any], where: str) -> Constraint:
    """``{kind: value}`` as a Constraint, exactly as given; :class:`RowError` naming ``where``."""
    try:
        return parse_constraint(spec)
    except ValueError as e:
        raise RowError(f"{where}: {e}"[:500]) from None


def cell_constraint(value: Any, where: str) -> Constraint | Off | None:
    """A ``structured`` cell (JSON text, struct or map): None when null (the default applies), OFF
    for the JSON text ``null``, else the constraint; :class:`RowError` naming ``where``."""
    if value is None:
        return None
    obj = _as_object(value, where)
    return OFF if obj is None else parse_spec(obj, where)


def _nested(key: str, value: Any) -> tuple[dict[str, Any], str]:
    """vLLM's ``guided_decoding``/``structured_outputs`` object → ({kind: value}, the field's name)."""
    obj = _as_object(value, f"sampling_params.{key}")
    if not isinstance(obj, dict):
        raise RowError(f"sampling_params.{key} must be an object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in (*VLLM_KINDS, "json_object", *_IGNORED_NESTED)]
    if unknown:
        raise RowError(f"sampling_params.{key}.{unknown[0]} is not supported (supported: "
                       f"{', '.join((*VLLM_KINDS, 'json_object'))})")
    given = [k for k in (*VLLM_KINDS, "json_object") if k in obj and obj[k] is not False]
    if len(given) != 1:
        raise RowError(f"sampling_params.{key} must set exactly one of {', '.join((*VLLM_KINDS, 'json_object'))}, "
                       f"got {given or 'none'}")
    if given[0] == "json_object":     # any JSON object, as vLLM's json_object=True
        return {"json_schema": {"type": "object"}}, f"sampling_params.{key}.json_object"
    return {VLLM_KINDS[given[0]]: obj[given[0]]}, f"sampling_params.{key}.{given[0]}"


def from_sampling_params(d: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """The constraint a processor row's ``sampling_params`` (null keys already dropped) asks for,
    and the field it came from (None, None without one). Two ways at once are the row's error."""
    given = [k for k in SAMPLING_PARAMS_KEYS if k in d]
    if len(given) > 1:
        raise RowError(f"sampling_params.{given[0]} and sampling_params.{given[1]} both ask for structured "
                       "output; give one")
    if not given:
        return None, None
    key = given[0]
    where = f"sampling_params.{key}"
    if key == STRUCTURED:
        c = cell_constraint(d[key], where)
        return (None if isinstance(c, Off) else c), where
    if key in NESTED_KEYS:
        spec, where = _nested(key, d[key])
        return parse_spec(spec, where), where
    value = d[key]
    if key == "guided_json" and not isinstance(value, str):
        value = _pruned(value)         # a struct read back from Arrow (JSON text is parsed by the engine)
    return parse_spec({VLLM_KINDS[key.removeprefix("guided_")]: value}, where), where


@functools.lru_cache(maxsize=4096)
def _compiles(tokenizer, c: Constraint) -> str | None:
    """Why ``c`` does not compile (``"does not compile: ..."``), or None."""
    from orthrus import check_structured    # the grammar compiler (and torch): only for rows with a constraint

    try:
        check_structured(tokenizer, c)
    except ConstraintError as e:     # refused: does not compile, exceeds a limit, admits no value
        return e.reason
    except Exception as e:  # noqa: BLE001 - whatever a row's constraint makes the compiler raise is its error
        return f"does not compile: {type(e).__name__}: {e}"
    return None


def compile_error(tokenizer, c: Constraint, where: str) -> str | None:
    """Why ``c`` does not compile for ``tokenizer`` (``"<where>: <kind> does not compile: ..."``),
    or None; each distinct constraint is compiled once per process (cached both ways)."""
    why = _compiles(tokenizer, c)
    return None if why is None else f"{where}: {c.kind} {why}"[:500]
