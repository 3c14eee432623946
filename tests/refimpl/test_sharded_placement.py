"""refimpl ZeRO-3's ``shard_placement_fn`` (refimpl/sharded/placement.py), in one 2-rank gloo world.

A placement changes where a parameter's values live, never a value: the gradients and
parameters after every backward and step are *bitwise* those of the flat-chunk engine, and a
parameter placed on dim 1 holds exactly ``torch.chunk(full, W, dim=1)[rank]`` (no padding),
also through ``reshard_after_forward`` and ``no_sync()``. A dim the ranks do not divide is
refused with what to do, and so is a DCP state dict (it keeps the flat layout).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refimpl.sharded import checkpoint
from refimpl.sharded.placement import shard_view
from refimpl.sharded.zero3 import FullyShardedDataParallel
from tests.refimpl._refimpl_world import run_world


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))  # 4x6 and 3x4: dim 1 even at W=2


def _dim1_where_even(p):
    return 1 if p.dim() == 2 and p.shape[1] % 2 == 0 else 0


def _train(model, rank):
    opt = model.make_optimizer(torch.optim.Adam, lr=0.01)
    out = []
    for step in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        with model.no_sync():
            model(x).pow(2).mean().backward()
        model(x + 1).pow(2).mean().backward()
        out.append(model.full_gradients())
        opt.step()
        opt.zero_grad()
        out.append(model.full_parameters())
    return out


def _placed(rank, world_size):
    net = _net(rank)
    placed = FullyShardedDataParallel(net, units=[net[0]], shard_placement_fn=_dim1_where_even)
    flat = FullyShardedDataParallel(_net(rank))  # flat chunks, one root unit: the same values
    got, want = _train(placed, rank), _train(flat, rank)
    same = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(got, want, strict=True))
    full = placed.full_parameters()
    chunks = {q.name: (q.dim, torch.equal(shard_view(q.shard.detach(), q.shape, q.dim, world_size),
                                          torch.chunk(full[q.name], world_size, dim=1)[rank]) if q.dim else None)
              for q in placed._params}
    refused = []
    try:
        FullyShardedDataParallel(_net(rank), shard_placement_fn=lambda p: 1 if p.dim() == 2 else 0)  # 3x4, 4x6: ok
        FullyShardedDataParallel(nn.Linear(3, 3), shard_placement_fn=lambda p: 1 if p.dim() == 2 else 0)
    except ValueError as e:
        refused.append(str(e))
    try:
        checkpoint.sharded_state_dict(placed)
    except ValueError as e:
        refused.append(str(e))
    return same, chunks, refused


def test_placement_changes_where_values_live_not_what_they_are():
    for rank, (same, chunks, refused) in enumerate(run_world(_placed, 2, timeout=180)):
        assert same, f"rank {rank}: a placed engine's gradients or parameters differ from the flat one's"
        assert chunks == {"0.weight": (1, True), "0.bias": (0, None), "2.weight": (1, True), "2.bias": (0, None)}, chunks
        assert len(refused) == 2 and "do not divide: return dim 0" in refused[0] and "full_state_dict" in refused[1]


def test_placement_dim_validation_without_a_world():
    from refimpl.sharded.placement import placement_dim

    p = nn.Parameter(torch.zeros(3, 4))
    assert placement_dim(None, p, 2, "w") == 0 and placement_dim(lambda q: -1, p, 2, "w") == 1
    with pytest.raises(ValueError, match="return a dim of the parameter"):
        placement_dim(lambda q: 5, p, 2, "w")
