"""refimpl.device_check: every tensor a collective sees is on the rank's device.

The CPU stand-in ([Note: the CPU stand-in] in refimpl/device_check.py): tensors built without
``device=`` land on 'meta' while the rank's tensors are on the CPU, so a collective fed a
device-less tensor is caught here as it would fail under NCCL. Each of refimpl's engines runs
one training step under it (world size 1: the same collectives as W ranks).
"""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refimpl import DistributedDataParallel as DDP
from refimpl.ddp.naive import NaiveDataParallel
from refimpl.device_check import COLLECTIVES, CollectiveDeviceError, expect_collective_device
from refimpl.sharded import FullyShardedDataParallel, ShardedDataParallel

ROOT = Path(__file__).resolve().parents[2]


def stand_in():
    return expect_collective_device("cpu", stray="meta")


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))


def x() -> torch.Tensor:
    return torch.arange(12.0, device="cpu").view(3, 4) / 7


def test_a_device_less_tensor_is_caught_with_its_collective_and_line(world1):
    original = dist.all_reduce
    with stand_in():
        assert dist.all_reduce is not original
        dist.all_reduce(torch.ones(2, device="cpu"), group=world1)  # the rank's device: fine
        with pytest.raises(CollectiveDeviceError) as err:
            dist.all_reduce(torch.ones(2), group=world1)  # no device=: lands on meta
        with pytest.raises(CollectiveDeviceError, match=r"tensor_list\[1\]"):
            dist.all_gather([torch.ones(1, device="cpu"), torch.ones(1)], torch.ones(1, device="cpu"), group=world1)
    assert dist.all_reduce is original  # restored untouched
    line = str(err.value)
    assert "\n" not in line and "dist.all_reduce got a tensor on meta" in line and "run on cpu" in line
    assert f"test_device_check.py:{_line_of('dist.all_reduce(torch.ones(2), group=world1)')}" in line


def _line_of(code: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if code in text)


def test_a_cuda_device_needs_its_index():
    with pytest.raises(ValueError, match="cuda:0"), expect_collective_device("cuda"):
        pass


def test_naive_data_parallel_keeps_every_collective_on_the_parameters_device(world1):
    model = NaiveDataParallel(net(), world1)
    model(x()).sum().backward()
    model.module[3].weight.grad = None  # a parameter without a gradient: the "who has one" map
    with stand_in():
        model.all_reduce_gradients()
    assert model.module[0].weight.grad.device.type == "cpu"


@pytest.mark.parametrize("options", [{}, {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["plain", "find-unused", "static-graph"])
def test_ddp_keeps_every_collective_on_the_parameters_device(world1, options):
    model = net()
    with stand_in():
        ddp = DDP(model, process_group=world1, bucket_cap_mb=0.0001, **options)
        for _ in range(3):  # the rebuild broadcast and the static graph's learnt steps included
            ddp(x()).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_sharded_engines_keep_every_collective_on_the_parameters_device(world1):
    for make in (lambda m: ShardedDataParallel(m, process_group=world1),
                 lambda m: FullyShardedDataParallel(m, world1, units=[m[0], m[2]])):
        model = net()
        with stand_in():
            engine = make(model)
            opt = engine.make_optimizer(torch.optim.SGD, lr=0.1) if hasattr(engine, "make_optimizer") else None
            engine(x()).sum().backward()
            engine.clip_grad_norm_(1.0)
            engine.clip_grad_norm_(1.0, norm_type=float("inf"))
            if opt is not None:
                opt.step()


# -- static: every collective is called by name on torch.distributed, at the call ---------------------
_NAMES = "|".join(COLLECTIVES)
_BOUND = re.compile(rf"\bdist\s*\.\s*({_NAMES})\b(?!\s*\()|\bfrom\s+torch\.distributed\s+import\s+[^\n]*\b({_NAMES})\b")


def _code(path: Path) -> str:
    with path.open("rb") as fh:
        return " ".join(tok.string for tok in tokenize.tokenize(fh.readline)
                        if tok.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING))


def test_refimpl_calls_every_collective_by_name_at_the_call():
    """A collective bound at import (``f = dist.all_reduce``) would escape the check."""
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sorted((ROOT / "refimpl").rglob("*.py"))
                 if p.name != "device_check.py" for m in _BOUND.finditer(_code(p))]
    assert not offenders, "collectives bound instead of called by name:\n" + "\n".join(offenders)


def test_the_binding_pattern_catches_what_it_must():
    assert _BOUND.search("f = dist.all_reduce") and _BOUND.search("getattr(x) or dist.reduce_scatter_tensor")
    assert _BOUND.search("from torch.distributed import all_reduce, broadcast")
    assert not _BOUND.search("dist.all_reduce(t, group=g)") and not _BOUND.search("dist.get_rank()")


def test_a_tensor_is_refused_only_where_its_backend_would_refuse_it(world1):
    """A CPU tensor is refused on an NCCL group (NCCL takes none) but not on a gloo group (an
    engine's own CPU side group is no bug); a tensor on another GPU than the rank's is refused."""
    import types

    from refimpl.device_check import _group_device_types, _misplaced

    on = lambda device: types.SimpleNamespace(device=torch.device(device))  # noqa: E731 - only .device is read
    rank = torch.device("cuda", 0)
    assert _group_device_types(world1) == {"cpu", "cuda"}  # gloo
    assert _misplaced(on("cpu"), rank, frozenset({"cuda"})) == "its group's backend takes no cpu tensor"
    assert _misplaced(on("cpu"), rank, frozenset({"cpu", "cuda"})) == ""
    assert _misplaced(on("cuda:1"), rank, frozenset({"cuda"})) == "another device than the rank's"
    assert _misplaced(on("cuda:0"), rank, frozenset({"cuda"})) == ""
    with expect_collective_device(rank):  # a rank on cuda:0 whose gloo group gets a CPU tensor
        dist.all_reduce(torch.ones(2), group=world1)
