"""The naive reducer (refimpl/ddp/naive.py) is the baseline the bucketed DDP must match.

One gloo world of 2 ranks: the same model, rank-dependent init and data go through
``NaiveDataParallel`` and through ``refimpl.DistributedDataParallel`` with small buckets (so
several buckets launch during backward); every gradient and every parameter after each SGD
step must be bitwise equal (2 ranks: the two-term sum is commutative and scaling by 1/2 is
exact). A model with a parameter no rank uses checks that it keeps ``grad=None`` in both.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refimpl import DistributedDataParallel as DDP
from refimpl.ddp.naive import NaiveDataParallel
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.h = nn.Linear(64, 4096)  # over the 1 MiB first bucket: several buckets
        self.b = nn.Linear(4096, 4)
        self.unused = nn.Linear(4, 4)  # no rank's forward reaches it

    def forward(self, x):
        return self.b(torch.relu(self.h(torch.relu(self.a(x)))))


def _world(rank, world_size):
    torch.manual_seed(100 + rank)  # rank-dependent init: both wrappers must broadcast rank 0's
    model = Net()
    naive = NaiveDataParallel(copy.deepcopy(model))
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=0.05, find_unused_parameters=True)
    assert len(ddp.reducer.plan) > 1, "the test needs several buckets"
    opts = [torch.optim.SGD(w.parameters(), lr=0.1) for w in (naive, ddp)]
    mismatches = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(-3, 4, (5, 8), generator=g).float()
        naive(x).pow(2).sum().backward()
        naive.all_reduce_gradients()
        ddp(x).pow(2).sum().backward()
        for (name, p), q in zip(naive.module.named_parameters(), ddp.module.parameters(), strict=True):
            if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
                mismatches.append(f"step {step} grad {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (name, p), q in zip(naive.module.named_parameters(), ddp.module.parameters(), strict=True):
            if not torch.equal(p, q):
                mismatches.append(f"step {step} param {name}")
    unused_none = naive.module.unused.weight.grad is None and ddp.module.unused.weight.grad is None
    dist.barrier()
    return mismatches, unused_none


def test_bucketed_ddp_matches_the_naive_reducer_bitwise():
    for mismatches, unused_none in run_world(_world, 2):
        assert not mismatches, mismatches
        assert unused_none
