"""refimpl.nested: one walker for forward inputs/outputs (DDP's device move, data_parallel)."""

import collections

import torch

from refimpl.nested import find_tensors, iter_tensors, move_to

P = collections.namedtuple("P", "a b")


def test_move_to_keeps_container_types():
    obj = (P(torch.ones(1), 2), [torch.zeros(2)], collections.OrderedDict(x=torch.ones(3)), "text")
    moved = move_to(obj, torch.device("cpu"), non_blocking=True)
    assert type(moved[0]) is P and moved[0].b == 2
    assert type(moved[1]) is list and type(moved[2]) is collections.OrderedDict
    assert moved[3] == "text"


def test_iter_and_find_tensors():
    obj = {"a": [torch.ones(1), (torch.zeros(1), 3)]}
    assert [p for p, _ in iter_tensors(obj)] == ["inputs['a'][0]", "inputs['a'][1][0]"]
    assert len(list(find_tensors(obj))) == 2
