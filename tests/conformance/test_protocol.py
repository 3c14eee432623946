"""The adapter protocol's typed seams: `ctx` (WrapContext) and per-scenario ownership (no processes)."""

from __future__ import annotations

import typing

import torch

from conformance.adapters.protocol import Adapter, WrapContext, owned
from conformance.harness.context import RankContext
from conformance.topology import Topology


def test_the_harness_context_is_a_wrap_context_and_wrap_is_typed_with_it():
    ctx = RankContext(rank=1, topology=Topology(world_size=2, backend="gloo", device="cpu"), group=object())
    assert isinstance(ctx, WrapContext)
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device) == (1, 2, "gloo", torch.device("cpu"))
    assert typing.get_type_hints(Adapter.wrap)["ctx"] is WrapContext


def test_a_context_without_a_group_is_not_a_wrap_context():
    class NoGroup:
        rank, world_size, device, backend = 0, 1, torch.device("cpu"), "gloo"

    assert not isinstance(NoGroup(), WrapContext)


def test_owns_for_decides_per_scenario_and_owns_is_the_fallback():
    class Engine:
        name, owns = "engine", frozenset({"optimizer"})

        def owns_for(self, scenario):
            return frozenset({"optimizer", "backward"}) if scenario == "half" else self.owns

    assert owned(Engine()) == {"optimizer"}
    assert owned(Engine(), "half") == {"optimizer", "backward"}
    assert owned(Engine(), "fp32") == {"optimizer"}
