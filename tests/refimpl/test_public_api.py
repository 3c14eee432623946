"""refimpl's written public API (docs/refimpl-api.md): every stable name imports, the packages
export nothing undocumented, and every deprecated module path imports with a warning that names
its new home."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import warnings
from pathlib import Path

import pytest

from refimpl import _deprecated
from tests.deprecated_paths import assert_moved_path_works

DOC = Path(__file__).resolve().parents[2] / "docs" / "refimpl-api.md"


def _table(section: str) -> list[list[str]]:
    """The rows of the first table under `## section`, as lists of the code spans of each cell."""
    text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [[" ".join(re.findall(r"`([^`]+)`", cell)) for cell in row.strip("|").split("|")] for row in rows]


STABLE = {row[0]: row[1].split() for row in _table("Stable")}
DEPRECATED = {row[0]: row[1] for row in _table("Deprecated")}


def test_the_document_lists_the_packages():
    assert {"refimpl", "refimpl.ddp", "refimpl.data_parallel", "refimpl.sharded",
            "refimpl.distributed_autograd"} <= set(STABLE)
    assert DEPRECATED == _deprecated.MOVED


@pytest.mark.parametrize("module", sorted(STABLE))
def test_every_stable_name_imports(module):
    mod = importlib.import_module(module)
    missing = [name for name in STABLE[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks documented names {missing}"


@pytest.mark.parametrize("module", sorted(STABLE))
def test_no_public_name_is_left_undocumented(module):
    exported = getattr(importlib.import_module(module), "__all__", None)
    if exported is None:
        pytest.skip(f"{module} has no __all__")
    undocumented = sorted(n for n in exported if not n.startswith("_") and n not in STABLE[module])
    assert not undocumented, f"{module} exports {undocumented}: document them (stable) or make them private"


def test_stable_names_are_the_objects_users_get():
    import refimpl
    from refimpl.ddp.wrapper import DistributedDataParallel
    from refimpl.sharded.engine import ShardedDataParallel

    assert refimpl.DistributedDataParallel is DistributedDataParallel
    assert refimpl.ShardedDataParallel is ShardedDataParallel
    assert refimpl.__version__ == importlib.metadata.version("gradparity")


@pytest.mark.parametrize("old", sorted(_deprecated.MOVED))
def test_a_deprecated_path_warns_and_gives_the_new_names(old):
    # refimpl.data_parallel.data_parallel is not imported afresh: it has no file, only its entry in
    # sys.modules (refimpl/data_parallel/__init__.py [Note: deprecated paths of 0.1.0])
    assert_moved_path_works(old, _deprecated.MOVED, _deprecated.REMOVED_IN,
                            fresh=old != "refimpl.data_parallel.data_parallel")


def test_renamed_names_keep_their_old_name():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from refimpl.bucketer import BucketState
    from refimpl.sharded.bucketer import StagingState

    assert BucketState is StagingState


def test_calling_the_data_parallel_package_warns_and_calls_the_function():
    import torch

    import refimpl
    from refimpl.data_parallel import data_parallel

    module = torch.nn.Linear(3, 2)
    x = torch.arange(12.0).reshape(4, 3)
    with pytest.warns(DeprecationWarning, match=r"refimpl\.data_parallel\.data_parallel \(the function\)"):
        old = refimpl.data_parallel(module, (x,), ["cpu", "cpu"])
    assert torch.equal(old, data_parallel(module, (x,), ["cpu", "cpu"]))
    assert callable(refimpl.data_parallel.data_parallel) and not isinstance(refimpl.data_parallel.data_parallel, type(refimpl))
