"""The packages' layering holds (read with ``ast``, type-checking and function-local imports
included): no import cycle among ``pipeline/``'s packages nor among ``orthrus/``'s modules;
``orthrus/`` never imports Ray or ``pipeline``; ``pipeline/`` uses only ``orthrus``' public API; and
``pipeline/``'s packages import only packages earlier in the intended order."""
from __future__ import annotations

from support.import_graph import cycles, files, graph, imports, packages

# pipeline/'s packages, lowest first: each may import only packages before it (docs/design.md §6).
ORDER = ("sections", "sampling_config", "config", "config_file", "exceptions", "tasks", "columns", "schema", "storage", "output", "requests", "inputs", "actor",
         "processor", "report", "run")
# What pipeline/ may import of orthrus: the package itself and the modules its docstring names as public.
PUBLIC = {"orthrus", "orthrus.constraints", "orthrus.metrics"}


def _orthrus_module(name: str, known: set[str]) -> str:
    """The longest orthrus module an import names (``orthrus.constraints.parse_constraint`` → ``orthrus.constraints``)."""
    parts = name.split(".")
    while ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def test_the_helper_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_among_pipeline_packages_nor_orthrus_modules():
    assert cycles(packages("pipeline")) == []
    assert cycles(graph("pipeline")) == []
    assert cycles(graph("orthrus")) == []


def test_orthrus_never_imports_ray_or_pipeline():
    for module, path in files("orthrus").items():
        bad = sorted(i for i in imports(path) if i.split(".")[0] in ("ray", "pipeline"))
        assert bad == [], f"{module} imports {bad}"


def test_pipeline_uses_only_orthrus_public_api():
    known = set(files("orthrus"))
    for module, path in files("pipeline").items():
        used = {_orthrus_module(i, known) for i in imports(path) if i.split(".")[0] == "orthrus"}
        assert used <= PUBLIC, f"{module} imports {sorted(used - PUBLIC)} (not orthrus' public API)"


def test_pipeline_packages_follow_the_intended_order():
    rank = {f"pipeline.{name}": i for i, name in enumerate(ORDER)}
    g = packages("pipeline")
    assert set(g) <= set(rank), f"packages missing from ORDER: {sorted(set(g) - set(rank))}"
    for package, deps in g.items():
        later = sorted(d for d in deps if rank[d] > rank[package])
        assert later == [], f"{package} imports {later}, which come after it in {ORDER}"
