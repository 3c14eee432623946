"""Fixtures shared by the area tests that run cases through the pipeline directly."""

import pytest


@pytest.fixture(scope="module")
def session():
    """An executor for `conformance.pipeline.check(scenario, adapter, session)`: warm pools, a timeout scale."""
    from conformance.pipeline import PoolExecutor

    executor = PoolExecutor(timeout_scale=2.0)
    yield executor
    executor.close()
