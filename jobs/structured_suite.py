"""A suite of structured-output constraints and an independent check of each completion.

Used by the structured-output bench and the job's end-to-end test: every constraint here is given
to the engine in the form a user writes it, and every completion that ends "stop" is checked with
tools that know nothing of the grammar engine: ``json`` + ``jsonschema`` for schemas, Python's
``re.fullmatch`` for patterns (written in the syntax both regex dialects share), membership for
choices, and a hand-written equivalent pattern for each grammar.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema


@dataclass(frozen=True)
class Case:
    """One constraint (``structured``: ``{kind: value}``) and, for grammars, a regex of their language."""

    name: str
    structured: dict[str, Any]
    language: str | None = None     # grammars only: a Python regex accepting exactly their strings


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


_STR = {"type": "string", "maxLength": 16}
SUITE: tuple[Case, ...] = (
    Case("person", {"json_schema": _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 150}})}),
    Case("flag", {"json_schema": _obj({"ok": {"type": "boolean"}})}),
    Case("enum_label", {"json_schema": _obj({"label": {"enum": ["bug", "feature", "question"]}})}),
    Case("score", {"json_schema": _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}})}),
    Case("tags", {"json_schema": _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                 "minItems": 1, "maxItems": 3}})}),
    Case("nested", {"json_schema": _obj({"user": _obj({"id": {"type": "integer"}, "admin": {"type": "boolean"}}),
                                         "active": {"type": "boolean"}})}),
    Case("optional", {"json_schema": _obj({"title": _STR, "year": {"type": "integer"}}, required=["title"])}),
    Case("int_array", {"json_schema": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                                       "maxItems": 4}}),
    Case("anyof", {"json_schema": _obj({"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}})}),
    Case("const", {"json_schema": _obj({"kind": {"const": "function"}, "arity": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 5}})}),
    Case("pattern_field", {"json_schema": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})}),
    Case("date", {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"}),
    Case("phone", {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}),
    Case("identifier", {"regex": r"[a-z_][a-z0-9_]{0,11}"}),
    Case("hex_color", {"regex": r"#[0-9a-f]{6}"}),
    Case("words", {"regex": r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."}),
    Case("yes_no", {"choice": ["yes", "no"]}),
    Case("sentiment", {"choice": ["positive", "negative", "neutral"]}),
    Case("python_kw", {"choice": ["def", "class", "lambda", "return", "yield"]}),
    Case("quoted", {"choice": ['say "hi"', "back\\slash", "naïve"]}),
    Case("lark_list", {"grammar": 'start: "[" num ("," num)* "]"\nnum: /[0-9]{1,3}/'}, r"\[[0-9]{1,3}(,[0-9]{1,3})*\]"),
    Case("gbnf_assign", {"grammar": 'root ::= name "=" value ";"\nname ::= [a-z]+\nvalue ::= [0-9]+'},
         r"[a-z]+=[0-9]+;"),
    Case("lark_call", {"grammar": 'start: NAME "(" (NAME ("," " " NAME)*)? ")"\nNAME: /[a-z]{1,8}/'},
         r"[a-z]{1,8}\(([a-z]{1,8}(, [a-z]{1,8})*)?\)"),
)


def valid(case: Case, text: str) -> bool:
    """Whether ``text`` (a completion that ended "stop") satisfies ``case``, checked independently."""
    kind, spec = next(iter(case.structured.items()))
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), spec)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    return re.fullmatch(case.language, text) is not None
