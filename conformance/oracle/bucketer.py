"""The `bucketer` area's oracle: what each reduce-scatter call must deliver, computed exactly.

A bucketed reduce-scatter gives rank `r` the sum over its group of every member's chunk for
`r`; the chunks are generated from the scenario (`conformance.catalogue.bucketer.chunk`), so the
expected value is that sum, formed here in the group's order.
"""

from __future__ import annotations

import torch

from conformance.catalogue.bucketer import chunk, group_members
from conformance.spec import Scenario


def expected_result(scenario: Scenario, round_: int, rank: int, index: int, call) -> torch.Tensor:
    """The sum over the members of the call's group of their chunk for `rank` (its group rank)."""
    members = group_members(call.group, rank, scenario.world_size)
    total = None
    for src in members:
        c = chunk(scenario, round_=round_, rank=src, index=index, dest=members.index(rank), call=call)
        total = c if total is None else total + c
    return total
