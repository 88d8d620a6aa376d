"""Import graphs of this repository's packages, read with ``ast`` (nothing is imported).

Every import of a file counts, wherever it is: module level, ``if TYPE_CHECKING:`` blocks and
function bodies. :func:`graph` gives module → modules of the same package it imports;
:func:`packages` collapses that to sub-packages (``pipeline.rows.source`` → ``pipeline.rows``);
:func:`cycles` finds the strongly connected components larger than one.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    """``orthrus/engine/step.py`` → ``orthrus.engine.step`` (a package's ``__init__`` → the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if not node.level:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it; ``from pkg import name`` also counts ``pkg.name``
    (it may be a module). Relative imports are made absolute."""
    module, out = module_name(path), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            if base:
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def files(package: str) -> dict[str, Path]:
    """Module name → file, for every ``.py`` file under ``package``."""
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def graph(package: str) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports (package ``__init__`` files left out: they
    re-export, and importing a submodule runs them whatever the submodule imports)."""
    found = files(package)
    mods = {m for m, p in found.items() if p.name != "__init__.py"}
    return {m: {i for i in imports(found[m]) if i in mods and i != m} for m in mods}


def package_of(module: str, depth: int) -> str:
    """The first ``depth`` parts of a module name (``pipeline.rows.source``, 2 → ``pipeline.rows``)."""
    return ".".join(module.split(".")[:depth])


def packages(package: str) -> dict[str, set[str]]:
    """:func:`graph` collapsed to ``package``'s direct children (sub-packages and top-level modules)."""
    depth = package.count(".") + 2
    out: dict[str, set[str]] = {}
    for m, deps in graph(package).items():
        p = package_of(m, depth)
        out.setdefault(p, set()).update(package_of(d, depth) for d in deps)
    for p, deps in out.items():
        deps.discard(p)
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph (one sorted list per strongly connected component larger than one)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:                      # Tarjan; graphs here have ~100 nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    """Every node ``start`` reaches (itself included)."""
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += g.get(v, ())
    return seen
