"""The graph walks behind find_unused_parameters and the idle-rank case (no processes)."""

import torch
from torch import nn

from refimpl.ddp.unused_params import reaches_any, unreached_params


def test_reaches_any_follows_nested_outputs_and_stops_at_parameters():
    lin, other = nn.Linear(3, 3), nn.Linear(3, 3)
    ids = {id(p) for p in lin.parameters()}
    x = torch.ones(2, 3)
    assert reaches_any({"a": [lin(x)]}, ids)
    assert not reaches_any((other(x),), ids)
    idle = x.clone().requires_grad_(True) * 2  # a loss that reaches no parameter
    assert not reaches_any(idle, ids)
    assert reaches_any(lin.weight, ids)  # the output is a parameter itself


def test_unreached_params_lists_the_unused():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    params = list(a.parameters()) + list(b.parameters())
    index_of = {id(p): i for i, p in enumerate(params)}
    assert unreached_params([a(torch.ones(1, 2))], index_of, len(params)) == [2, 3]
