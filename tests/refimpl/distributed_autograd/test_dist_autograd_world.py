"""The slow tests' RPC world listens on loopback only (conformance/harness/network.py)."""

from __future__ import annotations

import os

import pytest

from conformance.harness.network import listeners_of


def _noop(world_size: int) -> None:
    """A check that only proves the world answers (RPC is up on every worker)."""


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
@pytest.mark.slow
def test_rpc_world_listens_on_loopback_only(rpc_world):
    rpc_world.run(_noop)
    listeners = listeners_of([p.pid for p in rpc_world.procs])
    assert listeners, "TensorPipe listens somewhere: finding no socket means the check is blind"
    wide = [str(s) for s in listeners if not s.loopback]
    assert not wide, f"RPC world sockets listening beyond loopback: {wide}"
