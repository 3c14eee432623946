"""The suite's layers: no import circle in conformance/, at most one in the tree, and no module
importing one of a higher layer (function-level imports count: see tests/import_graph.py)."""

import textwrap

import pytest

from tests.import_graph import ROOT, circles, edges, modules

# conformance/, bottom to top. A module belongs to the longest prefix that names it; it may
# import its own layer and those below. A new module needs a place here (the last test says so).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("conformance.spec", "conformance.topology", "conformance.catalogue.profiles",
                    "conformance.semantics", "conformance.expectations")),
    ("models, features, comparison, failures", ("conformance.models", "conformance.features", "conformance.compare",
                                                "conformance.envelope", "conformance.anchor", "conformance.shards",
                                                "conformance.clip_bound", "conformance.replica_oracle",
                                                "conformance.accumulation", "conformance.deepspeed_clip",
                                                "conformance.loss_scaler", "conformance.allreduce_order",
                                                "conformance.failure",
                                                "conformance.baseline_events")),
    ("catalogue", ("conformance.catalogue",)),
    ("oracles and engines", ("conformance.baseline", "conformance.baseline_features", "conformance.adapters",
                             "conformance.mutants", "conformance.feature_support",
                             "conformance.powersgd_oracle", "conformance.baseline_mixed")),
    ("judging and rank tasks", ("conformance.contract", "conformance.runners")),
    ("area registry", ("conformance.area",)),
    ("running and reporting", ("conformance.harness", "conformance.report", "conformance.plan",
                               "conformance.validation", "conformance.pipeline", "conformance.recording",
                               "conformance.compare_runs")),
    ("front ends", ("conformance.options", "conformance.zoo", "conformance.cli", "conformance.plugin",
                    "conformance.harness.torchrun", "conformance.suite")),
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
    assert conformance_graph["conformance.spec"] == set()  # the ground floor


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
