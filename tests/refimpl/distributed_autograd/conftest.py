from __future__ import annotations

import pytest

from tests.refimpl.distributed_autograd.dist_autograd_world import RpcWorld

_state: dict[str, RpcWorld] = {}


@pytest.fixture
def rpc_world():
    """A warm world of 3 RPC workers shared by the slow tests (fresh after a timeout)."""
    world = _state.get("world")
    if world is None or world.broken:
        world = _state["world"] = RpcWorld()
    return world


def pytest_sessionfinish(session, exitstatus):
    world = _state.pop("world", None)
    if world is not None:
        world.close()
