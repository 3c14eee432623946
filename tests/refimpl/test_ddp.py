"""Multi-process tests of refimpl's DistributedDataParallel (gloo, CPU, 127.0.0.1).

Each test spawns one world and runs many checks in it (a spawn costs ~3 s here). Every
check compares refimpl's gradients after each backward with a single-process baseline
``(1/W) sum_r grad L_r`` and, where torch supports the option, with torch's DDP; and checks
that gradients are bitwise identical across ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from refimpl import DistributedDataParallel as DDP
from refimpl.ddp.comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ models / data
class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(8, 16, dtype=dtype)
        self.b = nn.Linear(16, 16, dtype=dtype)
        self.c = nn.Linear(16, 4, dtype=dtype)
        self.frozen = nn.Linear(4, 4, dtype=dtype).requires_grad_(False)
        self.register_buffer("scale", torch.ones(4, dtype=dtype))

    def forward(self, x, use_b=True, idle=False):
        if idle:  # a forward that reaches no parameter (pytorch/pytorch#40566)
            return x[:, :4].clone().requires_grad_(True) * 1.0
        h = torch.relu(self.a(x))
        if use_b:
            h = torch.relu(self.b(h))
        return self.frozen(self.c(h)) * self.scale


class Mixed(nn.Module):
    """fp64 and fp32 (and tied) parameters: separate buckets, one gradient for the tie."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        h = self.mid(h.double()).float()
        return self.out(torch.tanh(h))


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.lin = nn.Linear(4, 2)

    def forward(self, idx, use_emb=True):
        h = self.emb(idx) if use_emb else torch.ones(len(idx), 4)
        return self.lin(h)


def data(step, k, r, shape=(4, 8)):
    g = torch.Generator().manual_seed(1000 * step + 10 * k + r)
    return torch.randn(*shape, generator=g)


def mse(model, x, rank, k=0, **kw):
    return model(x, **kw).pow(2).mean()


# ------------------------------------------------------------------ the checker
def check(rank, W, make_model, kwargs, loss_fn=mse, steps=3, micro=1, torch_too=True,
          atol=1e-6, rtol=1e-5, hook=None, data_fn=data, pg=None, label=""):
    """Train ``steps`` steps with refimpl DDP (and torch DDP) and compare with the baseline."""
    pg = pg if pg is not None else dist.group.WORLD
    W = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    torch.manual_seed(1234 + dist.get_rank())  # rank-dependent init: construction must sync
    model = make_model()
    ddp = DDP(copy.deepcopy(model), process_group=pg, **kwargs)
    wrapped = {"refimpl": ddp}
    if torch_too:
        wrapped["torch"] = TorchDDP(copy.deepcopy(model), process_group=pg, **kwargs)
    if hook is not None:
        for w in wrapped.values():
            w.register_comm_hook(pg, hook)
    base = copy.deepcopy(ddp.module)  # rank 0's state after the init broadcast
    _assert_same_across_ranks(dict(base.state_dict()), pg, f"{label} init")
    opts = {k: torch.optim.SGD(w.parameters(), lr=0.1) for k, w in wrapped.items()}
    base_opt = torch.optim.SGD(base.parameters(), lr=0.1)
    for step in range(steps):
        for k in range(micro):
            x = data_fn(step, k, rank)
            for w in wrapped.values():
                if k < micro - 1:
                    with w.no_sync():
                        loss_fn(w, x, rank, k).backward()
                else:
                    loss_fn(w, x, rank, k).backward()
        total = sum(loss_fn(base, data_fn(step, k, r), r, k) for r in range(W) for k in range(micro))
        (total / W).backward()
        for name, w in wrapped.items():
            where = f"{label} [{name} vs baseline] step {step}"
            for (pname, p), q in zip(w.module.named_parameters(), base.parameters(), strict=True):
                if q.grad is None:
                    assert p.grad is None or not p.grad.any(), f"{where}: {pname} should have no grad"
                    continue
                assert p.grad is not None, f"{where}: {pname} has no grad"
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                e = q.grad.to_dense() if q.grad.is_sparse else q.grad
                assert torch.allclose(g, e, atol=atol, rtol=rtol), (
                    f"{where}: {pname} max err {(g - e).abs().max().item()}"
                )
            if name == "refimpl":
                _assert_same_across_ranks(
                    {n: p.grad for n, p in w.module.named_parameters() if p.grad is not None}, pg, where
                )
        for opt in [*opts.values(), base_opt]:
            opt.step()
            opt.zero_grad()
    return ddp


def _assert_same_across_ranks(tensors, pg, where):
    for name, t in tensors.items():
        t = t.to_dense() if t.is_sparse else t
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(gathered, t.contiguous(), group=pg)
        for r, other in enumerate(gathered):
            assert torch.equal(other, gathered[0]), f"{where}: {name} differs between rank 0 and rank {r}"


# ------------------------------------------------------------------ rank bodies
def _plain(rank, W):
    for kw in [{}, {"gradient_as_bucket_view": True}, {"static_graph": True},
               {"bucket_cap_mb": 0.0005}, {"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True}]:
        ddp = check(rank, W, Net, kw, label=str(kw))
        assert ddp.reducer.buckets_rebuilt
        plan = [b.param_indices for b in ddp.bucket_plan]
        gathered = [None] * W
        dist.all_gather_object(gathered, plan)
        assert all(p == plan for p in gathered), f"{kw}: bucket plans differ across ranks: {gathered}"
        if "bucket_cap_mb" in kw:
            assert len(plan) > 1, plan
    # gradient_as_bucket_view: grads alias the flat buckets after an iteration
    ddp = check(rank, W, Net, {"gradient_as_bucket_view": True}, steps=2)
    ddp(data(0, 0, rank)).sum().backward()
    for i, p in enumerate(ddp.reducer._params):
        bucket = ddp.reducer._bucket_of[i].buffer
        assert p.grad.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr(), i
    # mixed dtypes + tied weights; fp16 / bf16 params
    ddp = check(rank, W, Mixed, {}, label="mixed")
    assert len({b.dtype for b in ddp.bucket_plan}) == 2
    assert sum(len(b.param_indices) for b in ddp.bucket_plan) == 3  # tied weight once
    for dt, tol in [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)]:
        check(rank, W, lambda dt=dt: Net(dt), {}, torch_too=False, atol=tol, rtol=tol,
              data_fn=lambda s, k, r, dt=dt: data(s, k, r).to(dt), label=str(dt))
    # frozen params excluded, state_dict keys prefixed, buffers from rank 0 before forward
    ddp = DDP(Net())
    names = set(ddp.reducer._names)
    assert not any(n.startswith("frozen") for n in names), names
    assert all(k.startswith("module.") for k in ddp.state_dict()), list(ddp.state_dict())
    assert set(ddp.state_dict()) == {f"module.{k}" for k in Net().state_dict()}
    ddp.module.scale.fill_(float(rank + 2))
    ddp(data(0, 0, rank)).sum().backward()
    assert torch.equal(ddp.module.scale, torch.full((4,), 2.0)), ddp.module.scale
    ddp2 = DDP(Net(), broadcast_buffers=False)
    ddp2.module.scale.fill_(float(rank + 2))
    ddp2(data(0, 0, rank)).sum().backward()
    assert torch.equal(ddp2.module.scale, torch.full((4,), float(rank + 2)))
    # backward stats: every param has a ready time, every bucket a launch and finish
    stats = ddp.get_backward_stats()
    assert all(t is not None and t >= 0 for t in stats.param_ready_ns), stats
    assert all(b.launch_ns is not None and b.finish_ns is not None for b in stats.buckets), stats
    assert 0.0 <= stats.overlap_fraction() <= 1.0 and stats.backward_end_ns is not None
    # world size 1 through the same code path, on explicit subgroups
    groups = [dist.new_group([r]) for r in range(W)]
    check(rank, W, Net, {}, pg=groups[rank], label="w1")
    check(rank, W, Net, {"find_unused_parameters": True},
          loss_fn=lambda m, x, r, k: mse(m, x, r, use_b=False), pg=groups[rank], label="w1-unused")


def _unused(rank, W):
    some = lambda m, x, r, k: mse(m, x, r, use_b=(r == 0))  # noqa: E731
    none = lambda m, x, r, k: mse(m, x, r, use_b=False)  # noqa: E731
    for kw in [{"find_unused_parameters": True},
               {"find_unused_parameters": True, "gradient_as_bucket_view": True},
               {"find_unused_parameters": True, "bucket_cap_mb": 0.0005}]:
        check(rank, W, Net, kw, loss_fn=some, label=f"unused-on-rank1 {kw}")
        ddp = check(rank, W, Net, kw, loss_fn=none, label=f"unused-everywhere {kw}")
        assert ddp.module.b.weight.grad is None and ddp.module.b.bias.grad is None
    # static graph with a parameter unused on every rank
    ddp = check(rank, W, Net, {"static_graph": True}, loss_fn=none, label="static-unused")
    assert ddp.module.b.weight.grad is None
    # no_sync accumulation, plain and with #69031 control flow (b only in micro-batch 0)
    check(rank, W, Net, {}, micro=3, label="no_sync")
    check(rank, W, Net, {"gradient_as_bucket_view": True}, micro=2, label="no_sync view")
    early = lambda m, x, r, k: mse(m, x, r, use_b=(k == 0))  # noqa: E731
    for kw in [{"find_unused_parameters": True},
               {"find_unused_parameters": True, "gradient_as_bucket_view": True}]:
        check(rank, W, Net, kw, loss_fn=early, micro=2, torch_too=False, label=f"69031 {kw}")
    # a rank whose forward uses no parameter at all (pytorch/pytorch#40566: torch aborts)
    idle = lambda m, x, r, k: mse(m, x, r, idle=(r == 1))  # noqa: E731
    check(rank, W, Net, {"find_unused_parameters": True}, loss_fn=idle, torch_too=False, label="40566")
    # rank-dependent: b used only in rank 1's no_sync micro-batch
    mixed = lambda m, x, r, k: mse(m, x, r, use_b=(k == 0 and r == 1))  # noqa: E731
    check(rank, W, Net, {"find_unused_parameters": True}, loss_fn=mixed, micro=2, torch_too=False,
          label="69031 rank1")


def _sparse_and_hooks(rank, W):
    idx = lambda s, k, r: torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(s * 7 + r))  # noqa: E731
    ddp = check(rank, W, SparseNet, {}, data_fn=idx, label="sparse")
    assert [b.sparse for b in ddp.bucket_plan].count(True) == 1
    check(rank, W, SparseNet, {"find_unused_parameters": True}, data_fn=idx, torch_too=False,
          loss_fn=lambda m, x, r, k: m(x, use_emb=(r == 0)).pow(2).mean(), label="sparse unused on rank1")
    ddp = check(rank, W, SparseNet, {"find_unused_parameters": True}, data_fn=idx, torch_too=False,
                loss_fn=lambda m, x, r, k: m(x, use_emb=False).pow(2).mean(), label="sparse unused")
    assert ddp.module.emb.weight.grad is None
    check(rank, W, Net, {}, hook=allreduce_hook, label="allreduce_hook")
    check(rank, W, Net, {"gradient_as_bucket_view": True}, hook=allreduce_hook, label="allreduce_hook view")
    check(rank, W, Net, {}, hook=fp16_compress_hook, atol=1e-3, rtol=1e-2, label="fp16 hook")
    check(rank, W, Net, {"gradient_as_bucket_view": True}, hook=bf16_compress_hook, atol=1e-2, rtol=5e-2,
          label="bf16 hook")
    ddp = DDP(Net())
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, allreduce_hook)
        ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ValueError, match="state, bucket"):
        DDP(Net()).register_comm_hook(None, lambda bucket: bucket)


class TwiceUsed(nn.Module):
    """The same layer under two reentrant checkpoints: its hook fires twice per backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.lin, x, use_reentrant=True)
        h = checkpoint(self.lin, torch.tanh(h), use_reentrant=True)
        return self.head(h)


def _errors(rank, W):
    # unused parameter without find_unused_parameters: raised at the end of *this* backward
    ddp = DDP(Net())
    with pytest.raises(RuntimeError, match=r"(?s)'b\.weight'.*find_unused_parameters=True"):
        ddp(data(0, 0, rank), use_b=False).sum().backward()
    ddp(data(0, 0, rank)).sum().backward()  # the wrapper is usable again afterwards
    # a parameter used outside the forward's outputs is marked ready twice
    ddp = DDP(Net(), find_unused_parameters=True)
    out = ddp(data(0, 0, rank), use_b=False)
    with pytest.raises(RuntimeError, match=r"'b\.(weight|bias)' was marked ready twice"):
        (out.sum() + ddp.module.b(torch.ones(1, 16)).sum()).backward()
    # reentrant backward: twice without static_graph, fine with it
    x = data(0, 0, rank).requires_grad_()
    ddp = DDP(TwiceUsed())
    with pytest.raises(RuntimeError, match=r"'lin\.(weight|bias)' was marked ready twice.*static_graph=True"):
        ddp(x).sum().backward()
    check(rank, W, TwiceUsed, {"static_graph": True}, torch_too=False,
          data_fn=lambda s, k, r: data(s, k, r).requires_grad_(), label="static reentrant")
    # next-forward check: a backward that died half-way is reported at the next forward
    ddp = DDP(Net())
    out = ddp(data(0, 0, rank))

    def boom(_):
        raise ValueError("user hook failed")

    ddp.module.a.weight.register_hook(boom)
    with pytest.raises(ValueError, match="user hook failed"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
        ddp(data(0, 0, rank))


# ------------------------------------------------------------------ tests
def test_plain_buckets_dtypes_buffers_stats_world1():
    run_world(_plain, 2)


def test_find_unused_and_no_sync():
    run_world(_unused, 2)


def test_sparse_embedding_and_comm_hooks():
    run_world(_sparse_and_hooks, 2)


def test_error_messages():
    run_world(_errors, 2)
