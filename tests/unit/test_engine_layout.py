"""The engine's layout holds: no import cycle in ``orthrus/`` (type-checking and function-local imports
included), the host side and the records import no torch, host and device never import each other,
and the device packs its one read in the layout ``packed.py`` describes."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from orthrus.engine.device.kernels import pack
from orthrus.engine.packed import COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (``if TYPE_CHECKING:`` and function bodies too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)   # ``from pkg import module``
    return out


def graph(package: str) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports (package ``__init__`` files left out: they
    re-export, and importing a submodule runs them whatever the submodule imports)."""
    files = {_module(p): p for p in (ROOT / package).rglob("*.py")}
    mods = {m for m, p in files.items() if p.name != "__init__.py"}
    return {m: {i for i in _imports(files[m]) if i in mods and i != m} for m in mods}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a module graph (one path per strongly connected component larger than one)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:                      # Tarjan; graphs here have ~100 nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
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


def _reach(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += g[v]
    return seen


def test_orthrus_has_no_import_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]   # the check finds one
    assert cycles(graph("orthrus")) == []


def test_the_host_side_and_the_records_import_no_torch():
    g = graph("orthrus")
    host = [m for m in g if m.startswith("orthrus.engine.host.")]
    records = ["orthrus.engine.step", "orthrus.engine.outputs", "orthrus.engine.packed", "orthrus.engine.transfers"]
    files = {_module(p): p for p in (ROOT / "orthrus").rglob("*.py")}
    for m in host + records:
        torchy = [d for d in _reach(g, m) if any(i == "torch" or i.startswith("torch.") for i in _imports(files[d]))]
        assert torchy == [], f"{m} reaches torch through {torchy}"


def test_host_and_device_never_import_each_other():
    g = graph("orthrus")
    for side, other in (("host", "device"), ("device", "host")):
        for m in (m for m in g if m.startswith(f"orthrus.engine.{side}.")):
            assert not {d for d in g[m] if d.startswith(f"orthrus.engine.{other}.")}, m


def test_the_device_packs_the_columns_the_host_unpacks():
    assert tuple(inspect.signature(pack).parameters)[1:] == COLUMNS
