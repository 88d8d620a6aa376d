"""Constraints the structured-output tests share: a small JSON schema, the prompts they run on (ids in
the tiny vocab-4097 model's range), and a grammar llguidance compiles but cannot follow for long."""
from __future__ import annotations

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = [[10, 11, 12], [300, 7, 8, 9, 1000, 22], [5], [42, 43]]
# Compiles, passes every check at add time, and fails inside the grammar engine a token or two in
# (at its first token without the letters): a rule with no base case grows the parser's items past
# llguidance's limit of 50,000.
EXPLODES = {"grammar": 'start: /[a-z]{4}/ a\na: "x" a'}
EXPLODES_AT_ONCE = {"grammar": 'start: a\na: "x" a'}
