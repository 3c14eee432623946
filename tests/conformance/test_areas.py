"""The one place an area is registered (conformance/areas/): every entry names pieces that exist,
and every list of areas elsewhere is read from the entries, in their order."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from conformance import area, areas, catalogue, mutants, spec
from conformance.adapters import registry

ROOT = Path(__file__).resolve().parents[2]


def test_every_list_of_areas_is_the_entries():
    names = tuple(e.name for e in areas.ENTRIES)
    assert names == areas.NAMES == spec.AREA_NAMES == tuple(catalogue.SCENARIOS) == tuple(area.AREAS)
    assert [e.order for e in areas.ENTRIES] == sorted(e.order for e in areas.ENTRIES)
    assert mutants.ZOO_AREAS == tuple(e.name for e in areas.ENTRIES if e.mutants)
    builtins = [n for n in registry.BUILTINS if n not in registry.ENGINE_ADAPTERS]
    assert builtins == [n for e in areas.ENTRIES for n in e.adapters]


@pytest.mark.parametrize("entry", areas.ENTRIES, ids=lambda e: e.name)
def test_an_entry_names_pieces_that_exist(entry):
    a = area.AREAS[entry.name]
    runner = importlib.import_module(entry.runner)
    assert (a.task, a.judge) == (runner.run, runner.judge)
    assert catalogue.HANDWRITTEN[entry.name] is areas.resolve(entry.catalogue) and a.oracle is areas.resolve(entry.oracle)
    assert a.scenarios is catalogue.SCENARIOS[entry.name]
    assert entry.oracle.startswith("conformance.oracle.")
    assert {s.area for s in a.scenarios()} == {entry.name}
    for ref in entry.adapters.values():
        module, _, factory = ref.partition(":")
        assert callable(getattr(importlib.import_module(module), factory)), ref
    assert set(entry.controls) <= set(entry.adapters)
    for module in (entry.mutants, entry.independent):
        if module:
            importlib.import_module(module)


@pytest.mark.parametrize("entry", areas.ENTRIES, ids=lambda e: e.name)
def test_an_area_has_its_suite_module_and_its_contract(entry):
    assert (ROOT / "conformance" / "suite" / f"test_{entry.name}.py").is_file()
    assert (ROOT / "docs" / "contracts" / f"{entry.name}.md").is_file()
