"""Adapter lookup: names, entry points, import paths, --ddp-class, and clear errors."""

import pytest
import torch

from conformance.adapters import registry
from conformance.spec import Capability


def test_builtin_by_name():
    a = registry.load("torch-ddp")
    assert a.name == "torch-ddp" and a.version == torch.__version__ and Capability.NO_SYNC in a.capabilities


def test_import_path_factory():
    assert registry.load("conformance.adapters.ddp_like:torch_ddp").name == "torch-ddp"


def test_ddp_class():
    a = registry.load("ddp-class=torch.nn.parallel:DistributedDataParallel")
    assert a.name == "DistributedDataParallel" and a.cls is torch.nn.parallel.DistributedDataParallel


def test_entry_point(monkeypatch):
    monkeypatch.setattr(registry, "_entry_points", lambda: {"my-ddp": "conformance.adapters.ddp_like:torch_ddp"})
    registry.load.cache_clear()
    assert registry.load("my-ddp").name == "torch-ddp"
    assert "my-ddp" in registry.known_adapters()
    registry.load.cache_clear()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-adapter", "unknown adapter 'no-such-adapter'; known:"),
        ("no_such_pkg.mod:factory", "cannot import 'no_such_pkg.mod'"),
        ("conformance.adapters.ddp_like:nope", "has no attribute 'nope'"),
        ("ddp-class=torch.nn:functional", "is not a class"),
        ("ddp-class=torch.nn.parallel", "is not of the form pkg.module:name"),
    ],
)
def test_errors_are_one_line_and_actionable(spec, message):
    with pytest.raises(registry.AdapterError) as info:
        registry.load(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def _factory_of_an_engine_not_installed():
    import no_such_engine_installed  # noqa: F401 - what an adapter of an absent engine does

    raise AssertionError("unreachable")


def _factory_that_raises():
    raise ValueError("bucket_cap_mb must be positive\nsecond line")


@pytest.mark.parametrize(
    "factory, message",
    [
        ("_factory_of_an_engine_not_installed", "needs 'no_such_engine_installed', which cannot be imported"),
        ("_factory_that_raises", "its factory raised ValueError: bucket_cap_mb must be positive; fix the factory"),
    ],
)
def test_a_factory_that_fails_is_one_actionable_line(factory, message):
    """Found by the Lightning Fabric newcomer run: an adapter whose engine was not installed ended
    in a 27-line traceback and exit status 1, not the one line and exit 2 of any other bad input."""
    registry.load.cache_clear()
    with pytest.raises(registry.AdapterError) as info:
        registry.load(f"tests.conformance.test_registry:{factory}")
    assert message in str(info.value) and "\n" not in str(info.value)
