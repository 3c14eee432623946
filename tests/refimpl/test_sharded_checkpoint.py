"""refimpl/sharded/checkpoint.py: ZeRO-2 and ZeRO-3 checkpoints through torch.distributed.checkpoint.

One 2-rank world trains a model 2 steps with Adam (state per element and a scalar step), saves,
rebuilds the engine from another seed, loads and trains 2 more: every parameter must be bitwise
what 4 steps straight through give. Sharded (DTensor, saved and loaded by DCP) and full state
dicts, both engines; plus a sharded checkpoint loaded at another world size (1), and the errors.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from torch import nn

from tests.refimpl._refimpl_world import run_world


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # 35, 7, 21, 3: padded at W=2


def _inputs(rank: int) -> list[torch.Tensor]:
    return [torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + i)) for i in range(4)]


def _round_trips(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp

    from refimpl.sharded import FullyShardedDataParallel, ShardedDataParallel
    from refimpl.sharded import checkpoint as ck

    def build(engine, seed):
        e = engine(_model(seed))
        return e, e.make_optimizer(torch.optim.Adam, lr=0.01)

    def train(e, o, xs):
        for x in xs:
            e(x).sum().backward()
            o.step()
            o.zero_grad()

    xs, out = _inputs(rank), {}
    for engine in (FullyShardedDataParallel, ShardedDataParallel):
        e, o = build(engine, 0)
        train(e, o, xs)
        straight = e.full_parameters()
        for kind in ("sharded", "full"):
            e, o = build(engine, 0)
            train(e, o, xs[:2])
            path = f"{directory}/{engine.__name__}-{kind}"
            saved = ck.sharded_state_dict(e, o) if kind == "sharded" else ck.full_state_dict(e, o)
            if kind == "sharded":
                dcp.save(saved, checkpoint_id=path)
            e, o = build(engine, 7)  # nothing of the first engine survives but the checkpoint
            if kind == "sharded":
                saved = ck.sharded_state_dict(e, o)
                dcp.load(saved, checkpoint_id=path)
            ck.load_state_dict(e, saved, o)
            train(e, o, xs[2:])
            got = e.full_parameters()
            out[f"{engine.__name__}/{kind}"] = [n for n in straight if not torch.equal(straight[n], got[n])]
    e, o = build(FullyShardedDataParallel, 0)
    train(e, o, xs[:2])
    dcp.save(ck.sharded_state_dict(e, o), checkpoint_id=f"{directory}/reshard")
    out["full-after-2"] = {n: t for n, t in e.full_parameters().items()}
    out["adam-step"] = o.optimizer.state[o.optimizer.param_groups[0]["params"][0]]["step"].item()
    try:
        ck.load_state_dict(e, {"model": {}}, o)
    except KeyError as exc:
        out["missing"] = str(exc)
    return out


def _load_at_one_rank(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp

    from refimpl.sharded import FullyShardedDataParallel
    from refimpl.sharded import checkpoint as ck

    e = FullyShardedDataParallel(_model(7))
    o = e.make_optimizer(torch.optim.Adam, lr=0.01)
    state = ck.sharded_state_dict(e, o)
    dcp.load(state, checkpoint_id=f"{directory}/reshard")
    ck.load_state_dict(e, state, o)
    return e.full_parameters(), o.optimizer.state[o.optimizer.param_groups[0]["params"][0]]["step"].item()


@pytest.mark.xdist_group("refimpl-zero3-worlds")
def test_save_load_train_on_equals_straight_through_and_reshards():
    directory = tempfile.mkdtemp(prefix="refimpl-ckpt-")
    try:
        results = run_world(_round_trips, 2, directory, timeout=240)
        for rank, out in enumerate(results):
            for case in ("FullyShardedDataParallel/sharded", "FullyShardedDataParallel/full",
                         "ShardedDataParallel/sharded", "ShardedDataParallel/full"):
                assert out[case] == [], f"rank {rank}, {case}: parameters differ from straight through: {out[case]}"
            assert "no entry for parameter" in out["missing"]
        (params, step), = run_world(_load_at_one_rank, 1, directory, timeout=120)
        want = results[0]["full-after-2"]
        assert all(torch.equal(params[n], want[n]) for n in want)  # saved at W=2, loaded at W=1
        assert step == results[0]["adam-step"] == 2
    finally:
        shutil.rmtree(directory, ignore_errors=True)
