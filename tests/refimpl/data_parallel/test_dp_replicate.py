"""replicate: gradient edges back to the original, tying, buffers, and the misuse policy."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from refimpl.data_parallel import (
    DataParallel,
    ReplicaMisuseError,
    data_parallel,
    is_replica,
    replicate,
)


def int_mlp(seed: int = 0) -> nn.Module:
    """Small-integer weights: fp32 sums are exact, so gradients compare bitwise."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    return m


def grads(m: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_replica_grads_reduce_add_into_original(n):
    m = int_mlp()
    x = torch.randint(-2, 3, (5, 4)).float()
    m(x).sum().backward()
    single = grads(m)
    m.zero_grad(set_to_none=True)

    replicas = replicate(m, ["cpu"] * n)
    assert len(replicas) == n
    sum(r(x).sum() for r in replicas).backward()
    for name, g in grads(m).items():
        assert torch.equal(g, n * single[name]), f"{name}: {g} != {n} * {single[name]}"


def test_replica_parameters_are_non_leaf_views_of_the_original():
    m = int_mlp()
    (r,) = replicate(m, ["cpu"])
    assert is_replica(r) and not is_replica(m)
    assert [n for n, _ in r.named_parameters()] == [n for n, _ in m.named_parameters()]
    for (name, t), p in zip(r.named_parameters(), m.parameters(), strict=True):
        assert not isinstance(t, nn.Parameter), name
        assert not t.is_leaf and t.requires_grad, name
        assert torch.equal(t, p)
    # nothing is registered as a parameter on the replica itself
    assert r[0]._parameters == {}
    assert r[0].weight is next(r[0].parameters())


def test_optimizer_over_replica_parameters_raises():
    (r,) = replicate(int_mlp(), ["cpu"])
    with pytest.raises(ValueError, match="non-leaf"):
        torch.optim.SGD(r.parameters(), lr=0.1)


def test_replicating_a_replica_raises():
    (r,) = replicate(int_mlp(), ["cpu"])
    with pytest.raises(ReplicaMisuseError, match="replica 0"):
        replicate(r, ["cpu", "cpu"])
    with pytest.raises(ReplicaMisuseError):
        data_parallel(r, torch.ones(2, 4), ["cpu", "cpu"])
    with pytest.raises(ReplicaMisuseError):
        DataParallel(r, ["cpu"])
    with pytest.raises(ReplicaMisuseError):  # a submodule of a replica is a replica too
        replicate(r[0], ["cpu"])


def test_replica_state_dict_raises():
    (r,) = replicate(int_mlp(), ["cpu"])
    with pytest.raises(ReplicaMisuseError, match="original module"):
        r.state_dict()


def test_replica_parameters_never_get_grad():
    m = int_mlp()
    (r,) = replicate(m, ["cpu"])
    r(torch.ones(2, 4)).sum().backward()
    with pytest.warns(UserWarning):  # torch warns on .grad of a non-leaf
        assert r[0].weight.grad is None
    assert m[0].weight.grad is not None


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(3, 5, bias=False)
        self.dec = nn.Linear(5, 3, bias=False)
        self.dec.weight = nn.Parameter(self.emb.weight.detach().t().contiguous())
        self.dec2 = nn.Linear(3, 5, bias=False)
        self.dec2.weight = self.emb.weight  # tied parameter
        self.shared = nn.Linear(5, 5)
        self.block = nn.Sequential(self.shared, nn.ReLU(), self.shared)  # shared submodule

    def forward(self, x):
        return self.dec(self.block(self.emb(x)) + self.dec2(x))


def test_tied_parameters_and_shared_submodules_stay_tied():
    m = Tied()
    for r in replicate(m, ["cpu"] * 3):
        assert r.dec2.weight is r.emb.weight
        assert r.block[0] is r.shared and r.block[2] is r.shared
        assert len(list(r.parameters())) == len(list(m.parameters()))
    x = torch.randn(4, 3)
    m(x).square().sum().backward()
    single = grads(m)
    m.zero_grad(set_to_none=True)
    a, b = replicate(m, ["cpu", "cpu"])
    (a(x[:2]).square().sum() + b(x[2:]).square().sum()).backward()
    for name, g in grads(m).items():
        torch.testing.assert_close(g, single[name], msg=name)


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]).requires_grad_())
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.lin(x) * self.scale


def test_buffers_requiring_grad_get_gradients():
    m = WithBuffers()
    x = torch.randn(4, 3)
    m(x).sum().backward()
    expected = m.scale.grad.clone()
    m.scale.grad = None
    a, b = replicate(m, ["cpu", "cpu"])
    assert not a.scale.is_leaf
    (a(x[:1]).sum() + b(x[1:]).sum()).backward()
    torch.testing.assert_close(m.scale.grad, expected)


def test_plain_buffers_first_same_device_replica_aliases_others_copy():
    m = WithBuffers()
    a, b, c = replicate(m, ["cpu"] * 3)
    assert a.count is m.count
    assert b.count.data_ptr() != m.count.data_ptr() and c.count.data_ptr() != b.count.data_ptr()
    for r in (a, b, c):
        r(torch.ones(1, 3))
    assert m.count.item() == 1.0  # only replica a's in-place update reaches the original
    assert b.count.item() == 1.0 and c.count.item() == 1.0


def test_unused_and_frozen_parameters_keep_grad_none():
    m = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2), "frozen": nn.Linear(2, 2)})
    m["frozen"].requires_grad_(False)
    a, b = replicate(m, ["cpu", "cpu"])
    out = a["frozen"](a["used"](torch.ones(1, 2))) + b["used"](torch.ones(1, 2))
    out.sum().backward()
    assert m["used"].weight.grad is not None
    assert m["unused"].weight.grad is None and m["frozen"].weight.grad is None
    assert a["frozen"].weight.is_leaf and not a["frozen"].weight.requires_grad


def test_detach_cuts_autograd():
    m = int_mlp()
    for r in replicate(m, ["cpu", "cpu"], detach=True):
        assert all(t.is_leaf and not t.requires_grad for t in r.parameters())
        assert not r(torch.ones(1, 4)).requires_grad


def test_double_backward_through_replicas():
    m = nn.Linear(3, 1)
    x = torch.randn(4, 3)

    def penalty(out_fn):
        y = out_fn().sum()
        (gw,) = torch.autograd.grad(y, m.weight, create_graph=True)
        return (gw**2).sum() + y

    penalty(lambda: m(x).tanh()).backward()
    expected = grads(m)
    m.zero_grad(set_to_none=True)
    penalty(lambda: torch.cat([r(c) for r, c in zip(replicate(m, ["cpu"] * 2), x.split(2), strict=True)]).tanh()).backward()
    for name, g in grads(m).items():
        torch.testing.assert_close(g, expected[name], msg=name)


def test_replicas_are_freed_without_garbage_collection():
    m = int_mlp()
    replicas = replicate(m, ["cpu", "cpu"])
    refs = [weakref.ref(r) for r in replicas]
    gc.disable()
    try:
        del replicas
        assert all(ref() is None for ref in refs), "replicas are kept alive by a reference cycle"
    finally:
        gc.enable()


def test_bad_devices():
    with pytest.raises(ValueError, match="empty"):
        replicate(int_mlp(), [])
    with pytest.raises(TypeError, match="list of devices"):
        replicate(int_mlp(), "cpu")


def test_parameter_caches_point_at_the_replica_copies():
    """RNNs compute from `_flat_weights`, a plain list of their parameters: each replica
    must get its own list holding its own copies, and the original's list must not change."""
    lstm = nn.LSTM(3, 4)
    before = list(lstm._flat_weights)
    a, b = replicate(lstm, ["cpu", "cpu"])
    for r in (a, b):
        assert r._flat_weights is not lstm._flat_weights
        assert all(w is getattr(r, n) for w, n in zip(r._flat_weights, r._flat_weights_names, strict=True))
    assert all(w is v for w, v in zip(lstm._flat_weights, before, strict=True))
    x = torch.randn(5, 2, 3)
    lstm(x)[0].sum().backward()
    expected = grads(lstm)
    lstm.zero_grad(set_to_none=True)
    (a(x[:, :1])[0].sum() + b(x[:, 1:])[0].sum()).backward()
    for name, g in grads(lstm).items():
        torch.testing.assert_close(g, expected[name], msg=name)
