"""Shared test configuration: pytester for the plugin/CLI tests; a one-rank process group."""

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def world1():
    """A gloo world of one rank in this process (HashStore: no socket), torn down after the module.

    A default group left by another test would make these tests run on someone else's world, or
    skip quietly; it is a leak to fix, so it fails here instead.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a default process group already exists in this process (a test leaked one)")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
