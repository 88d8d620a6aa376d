"""Structured-output constraints of a request: what a row's completion must match.

``SamplingParams(structured=...)`` takes exactly one of (the names vLLM's guided decoding and the
OpenAI ``response_format`` users already know):

- ``{"json_schema": {...}}``: a JSON value valid under the schema (a dict, or its JSON text);
- ``{"regex": "..."}``: text matching the whole regular expression;
- ``{"choice": ["a", "b", ...]}``: exactly one of the strings;
- ``{"grammar": "..."}``: text of an EBNF grammar, in Lark syntax (``start: ...``) or GBNF
  (``root ::= ...``, llama.cpp's, converted).

Here the shape is checked and the constraint normalised to a hashable :class:`Constraint` (the key
of the engine's compiled-grammar cache, so two rows with the same schema compile it once); whether
the schema, pattern or grammar itself is valid is found when the engine compiles it for the
tokenizer (``engine/host/grammar.py``), and is then that request's ``ValueError``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20    # a constraint's text; anything longer is a mistake, not a schema


@dataclass(frozen=True)
class Constraint:
    """One normalised constraint: ``kind`` (one of ``KINDS``) and ``spec``, its canonical text (the
    schema as compact JSON in its own key order, the regex, the choices as a JSON list, the grammar)."""

    kind: str
    spec: str

    @property
    def field(self) -> str:
        """Where it came from, for error messages: ``structured.json_schema`` etc."""
        return f"structured.{self.kind}"

    def as_dict(self) -> dict[str, Any]:
        """The ``{kind: value}`` form it was given in (schemas and choices parsed back)."""
        value = json.loads(self.spec) if self.kind in ("json_schema", "choice") else self.spec
        return {self.kind: value}


class ConstraintError(ValueError):
    """A constraint this engine cannot use: ``field`` (``structured.<kind>``) and ``reason`` (a
    sentence after it), so callers can name their own field instead (``column 'structured'``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"SamplingParams.{field} {reason}"[:2000])
        self.field, self.reason = field, reason


def parse_constraint(value: Any) -> Constraint | None:
    """``None`` / a :class:`Constraint` / ``{kind: value}`` → a Constraint (or None); a ``ValueError``
    naming ``SamplingParams.structured`` and the key for anything else."""
    if value is None or isinstance(value, Constraint):
        return value
    where = "SamplingParams.structured"
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{where} must be a dict with exactly one of {list(KINDS)}, got {keys}")
    kind, spec = next(iter(value.items()))
    text = _canonical(kind, spec, f"{where}.{kind}")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{where}.{kind} is {len(text)} characters; the limit is {MAX_SPEC_CHARS}")
    return Constraint(kind, text)


def _canonical(kind: str, spec: Any, where: str) -> str:
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError(f"{where} must be a JSON schema (an object), got {type(spec).__name__}")
        # key order kept: a schema's "properties" order is the order the grammar emits them in
        return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        if not (isinstance(spec, (list, tuple)) and spec and all(isinstance(c, str) and c for c in spec)):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings, got {spec!r}"[:300])
        return json.dumps(list(spec), ensure_ascii=False)
    if not (isinstance(spec, str) and spec.strip()):
        raise ValueError(f"{where} must be a non-empty string, got {spec!r}"[:300])
    return spec
