"""The test tree's own rules: tiers are folders, and no test module imports another (shared code lives
in ``tests/support``, shared fixtures in ``tests/conftest.py``)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_test_module_imports_another():
    offenders = {str(p.relative_to(TESTS)): sorted(m for m in _imported(p)
                                                   if m.split(".")[-1].startswith("test_")
                                                   or m.split(".")[-1] == "conftest" or m.startswith("tests."))
                 for p in TESTS.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_test_module_sits_in_a_tier():
    loose = [p.name for p in TESTS.glob("test_*.py")]
    assert loose == [] and {p.parent.name for p in TESTS.rglob("test_*.py")} == {"unit", "engine", "e2e"}
