"""What can be known about a constraint before any token: the grammar engine's limits it would hit,
and whether its language holds any non-empty text at all.

llguidance parses with an Earley parser whose rows hold at most ``max_items_in_row`` (2,000) items
and whose steps build at most ``step_max_items`` (50,000). Past either, the matcher enters an error
state mid-decode ("Current row has 5001 items; max is 2000", "Too many items (limit 50000)"). Two
shapes reach them predictably, so they are refused when the request is added, naming the field and
the limit (measured with llguidance 1.x on the bundled and Qwen3 tokenizers):

- a ``choice`` list: its row holds one item per choice plus one;
- a JSON object with many optional properties: its row holds about four items per optional
  property plus seven (498 optional properties fit, 499 do not).

A language with no finite value is refused too: a JSON schema whose every value must nest without
end (``{"$ref": "#"}``, definitions that only refer to each other, a required property that refers
back to its object) would otherwise end at once with empty text or run into the item limit.
Anything these checks miss fails inside a step, and then ends only its own row (``grammar.py``).
"""
from __future__ import annotations

import json
from typing import Any

from orthrus.constraints import Constraint, ConstraintError

MAX_ITEMS_IN_ROW = 2000                                  # llguidance's default ParserLimits.max_items_in_row
MAX_CHOICES = MAX_ITEMS_IN_ROW - 10                      # one item per choice, plus one; a margin
MAX_OPTIONAL_PROPERTIES = (MAX_ITEMS_IN_ROW - 7) // 4 - 8   # ~4 items each plus 7; a margin (490)


def check_limits(c: Constraint) -> None:
    """Raise :class:`ConstraintError` if ``c`` would exceed the grammar engine's limits or admits no
    non-empty value (the checks that need no tokenizer)."""
    if c.kind == "choice":
        n = len(json.loads(c.spec))
        if n > MAX_CHOICES:
            raise ConstraintError(c.field, f"has {n} choices; the limit is {MAX_CHOICES} (the grammar engine "
                                           f"holds at most {MAX_ITEMS_IN_ROW} parse items at one position)")
    elif c.kind == "json_schema":
        schema = json.loads(c.spec)
        where, n = _most_optional(schema)
        if n > MAX_OPTIONAL_PROPERTIES:
            raise ConstraintError(c.field, f"has an object with {n} optional properties at {where}; the limit is "
                                           f"{MAX_OPTIONAL_PROPERTIES} (mark more of them required, or split the object)")
        if not admits_a_value(schema):
            raise ConstraintError(c.field, "admits no JSON value: it is false, or every value it describes would "
                                           "nest without end (it only refers to itself, or a required property does)")


def _walk(schema: Any) -> list[tuple[str, Any]]:
    """Every dict in the schema document with its JSON pointer, children before parents (iterative:
    deep nesting cannot overflow the stack)."""
    out, stack = [], [("#", schema, False)]
    while stack:
        where, node, expanded = stack.pop()
        if expanded:
            out.append((where, node))
            continue
        if isinstance(node, dict):
            stack.append((where, node, True))
            stack.extend((f"{where}/{_escape(k)}", v, False) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{where}/{i}", v, False) for i, v in enumerate(node))
    return out


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _most_optional(schema: Any) -> tuple[str, int]:
    """The object schema with the most optional properties: (its pointer, how many)."""
    best = ("#", 0)
    for where, node in _walk(schema):
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required") if isinstance(node.get("required"), list) else []
            n = len(set(props) - set(required))
            if n > best[1]:
                best = (where, n)
    return best


def _resolve(root: Any, ref: Any) -> Any:
    """The node a local ``$ref`` ("#", "#/$defs/a") points at; None when it is not local or not there
    (then llguidance judges it)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def admits_a_value(root: Any) -> bool:
    """Whether some finite JSON value satisfies the schema's structure (references, required
    properties, minimum items, allOf/anyOf/oneOf); other keywords are taken as satisfiable, so this
    only refuses schemas that are empty by construction. The least fixpoint: every subschema starts
    "no value", and becomes "has one" once its parts do; children are visited before parents, so a
    schema without recursion settles in one pass."""
    nodes = [node for _, node in _walk(root)]
    known = {id(n): False for n in nodes}
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if not known[id(node)] and _has_value(node, root, known):
                known[id(node)] = changed = True
    return _value(root, known)


def _value(node: Any, known: dict[int, bool]) -> bool:
    if isinstance(node, bool):
        return node
    return known.get(id(node), True) if isinstance(node, dict) else True


def _has_value(node: dict, root: Any, known: dict[int, bool]) -> bool:
    """One subschema, given what is known of its parts."""
    if "const" in node or "enum" in node:
        return True
    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not None and not _value(target, known):
            return False
    if "allOf" in node and not all(_value(s, known) for s in _list(node["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and _list(node[key]) and not any(_value(s, known) for s in _list(node[key])):
            return False
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    return any(_type_has_value(t, node, known) for t in types) if types else True


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _type_has_value(typ: Any, node: dict, known: dict[int, bool]) -> bool:
    """Whether a value of ``typ`` can satisfy the node's required properties or minimum items."""
    if typ == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        return all(_value(props[name] if name in props else extra, known)
                   for name in _list(node.get("required")) if isinstance(name, str))
    if typ == "array":
        need = node.get("minItems", 0)
        need = need if isinstance(need, int) else 0
        prefix = _list(node.get("prefixItems"))
        if not all(_value(s, known) for s in prefix[:need]):
            return False
        return need <= len(prefix) or _value(node.get("items", True), known)
    return True
