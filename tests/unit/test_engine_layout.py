"""The engine's layout holds: no import cycle in ``orthrus/`` (type-checking and function-local imports
included), the host side and the records import no torch, host and device never import each other,
and the device packs its one read in the layout ``packed.py`` describes."""
from __future__ import annotations

import inspect

from orthrus.engine.device.kernels import pack
from orthrus.engine.packed import COLUMNS

from support.import_graph import cycles, files, graph, imports, reach


def test_orthrus_has_no_import_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]   # the check finds one
    assert cycles(graph("orthrus")) == []


def test_the_host_side_and_the_records_import_no_torch():
    g = graph("orthrus")
    host = [m for m in g if m.startswith("orthrus.engine.host.")]
    records = ["orthrus.engine.step", "orthrus.engine.outputs", "orthrus.engine.packed", "orthrus.engine.transfers"]
    found = files("orthrus")
    for m in host + records:
        torchy = [d for d in reach(g, m) if any(i == "torch" or i.startswith("torch.") for i in imports(found[d]))]
        assert torchy == [], f"{m} reaches torch through {torchy}"


def test_host_and_device_never_import_each_other():
    g = graph("orthrus")
    for side, other in (("host", "device"), ("device", "host")):
        for m in (m for m in g if m.startswith(f"orthrus.engine.{side}.")):
            assert not {d for d in g[m] if d.startswith(f"orthrus.engine.{other}.")}, m


def test_the_device_packs_the_columns_the_host_unpacks():
    assert tuple(inspect.signature(pack).parameters)[1:] == COLUMNS
