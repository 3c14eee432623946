"""The suite's layers: no import circle in conformance/, at most one in the tree, and no module
importing one of a higher layer (function-level imports count: see tests/import_graph.py)."""

import textwrap

import pytest

from conformance._deprecated import MOVED
from tests.import_graph import ROOT, circles, edges, modules

# conformance/, bottom to top. A module belongs to the longest prefix that names it; it may
# import its own layer and those below. A new module needs a place here (the last test says so).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("conformance.areas", "conformance.spec", "conformance.topology", "conformance.cuda_setup",
                    "conformance.catalogue.profiles",
                    "conformance.space.covering",
                    "conformance.semantics", "conformance.expectations", "conformance._deprecated",
                    "conformance._version")),
    ("models and features", ("conformance.models", "conformance.features")),
    ("catalogue", ("conformance.catalogue", "conformance.space")),
    ("oracle", ("conformance.oracle",)),
    ("judge", ("conformance.judge",)),
    ("adapters and mutants", ("conformance.adapters", "conformance.mutants")),
    ("rank tasks", ("conformance.runners",)),
    ("area registry", ("conformance.area",)),
    ("cases and the rank harness", ("conformance.case", "conformance.harness")),
    ("planning, the pipeline and reporting", ("conformance.plan", "conformance.pipeline", "conformance.validation",
                                              "conformance.recording", "conformance.report",
                                              "conformance.coverage")),
    ("front ends", ("conformance.frontends", "conformance.suite")),
    # the old paths of moved modules: each imports only `conformance._deprecated` (#41; removed in 0.3.0)
    ("deprecated paths", tuple(MOVED)),
]
VOCABULARY = LAYERS[0][1]


def layer_of(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


@pytest.fixture(scope="module")
def conformance_graph():
    return edges(modules(ROOT, ("conformance",)))


def test_no_import_circle_in_conformance(conformance_graph):
    assert circles(conformance_graph) == []


def test_at_most_one_import_circle_in_the_tree():
    found = circles(edges(modules()))
    assert len(found) <= 1, f"{len(found)} import circles (python3 -m tests.import_graph): {found}"


def test_the_vocabulary_imports_nothing_above_it(conformance_graph):
    vocabulary = {m for m in conformance_graph if layer_of(m) == 0}
    assert set(VOCABULARY) <= vocabulary  # every name is a module
    above = {m: sorted(conformance_graph[m] - vocabulary) for m in sorted(vocabulary)}
    assert not any(above.values()), f"the vocabulary imports from above it: {above}"
    # the ground floor: the area entries (plain strings), which the vocabulary names its areas from
    assert {m: conformance_graph[m] for m in conformance_graph if m.startswith("conformance.areas")} == {
        "conformance.areas": {"conformance.areas.entry"}, "conformance.areas.entry": set(),
        **{m: {"conformance.areas.entry"} for m in conformance_graph if m.startswith("conformance.areas.")
           and m != "conformance.areas.entry"}}
    assert conformance_graph["conformance.spec"] == {"conformance.areas"}


def test_no_module_imports_a_higher_layer(conformance_graph):
    upward = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m in sorted(conformance_graph) if layer_of(m) is not None
        for t in sorted(conformance_graph[m]) if layer_of(t) is not None and layer_of(t) > layer_of(m)
    ]
    assert not upward, "imports that climb a layer:\n" + "\n".join(upward)


def test_every_conformance_module_has_a_layer(conformance_graph):
    unplaced = sorted(m for m in conformance_graph if m != "conformance" and layer_of(m) is None)
    assert not unplaced, f"modules in no layer of tests/test_import_layers.py LAYERS: {unplaced}"


def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return edges(modules(tmp_path, ("pkg",)))


def test_the_graph_counts_function_level_relative_and_typing_imports(tmp_path):
    graph = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "def f():\n    from pkg.high import g\n",  # function-level: a deferred circle
        "pkg/high.py": "from . import low\n",
        "pkg/sub/__init__.py": "from .a import A\n",  # a package re-exporting its module: no circle
        "pkg/sub/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\nA = 1\n",
        "pkg/sub/b.py": "from pkg.sub.a import A\nB = 2\n",
        "pkg/leaf.py": "import os\nfrom pkg.sub import A\n",
    })
    assert graph["pkg.high"] == {"pkg.low"} and graph["pkg.low"] == {"pkg.high"}
    assert graph["pkg.leaf"] == {"pkg.sub"}
    assert circles(graph) == [["pkg.high", "pkg.low"], ["pkg.sub.a", "pkg.sub.b"]]
    runtime = edges(modules(tmp_path, ("pkg",)), runtime_only=True)
    assert circles(runtime) == [["pkg.high", "pkg.low"]]
