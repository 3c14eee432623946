"""Fixtures shared by the area tests that drive a driver's `check` directly."""

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def session():
    """What `check(scenario, adapter, session)` needs: warm pools and a timeout scale."""
    from conformance.harness.pool import PoolManager

    pools = PoolManager()
    yield SimpleNamespace(pools=pools, timeout_scale=2.0)
    pools.close()
