"""data_parallel / DataParallel: gradients equal a plain full-batch forward/backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import refimpl
from refimpl.data_parallel import DataParallel, data_parallel


def int_init(m: nn.Module, seed: int = 0) -> nn.Module:
    """Small-integer weights and data: fp32 sums are exact, so we can compare bitwise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    return m


def ints(*shape, seed=1):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


def grads(m):
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def check(model, inputs, loss_fn, n, *, exact, kwargs=None, dim=0):
    """Compare data_parallel over n CPU devices against the plain model, output and grads."""
    plain = copy.deepcopy(model)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    expected_out = plain(*args, **(kwargs or {}))
    loss_fn(expected_out).backward()
    out = data_parallel(model, inputs, ["cpu"] * n, dim=dim, module_kwargs=kwargs)
    loss_fn(out).backward()
    cmp = (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg)) if exact else (
        lambda a, b, msg: torch.testing.assert_close(a, b, msg=msg)
    )
    torch.testing.assert_close(out, expected_out) if isinstance(out, torch.Tensor) else None
    expected, actual = grads(plain), grads(model)
    for name in expected:
        if expected[name] is None:
            assert actual[name] is None, name
        else:
            cmp(actual[name], expected[name], f"n={n} {name}")
    return out


def mlp():
    return int_init(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [8, 7, 3, 1])
def test_mlp_exact(n, batch):
    w = ints(batch, 3, seed=2)
    check(mlp(), ints(batch, 4), lambda o: (o * w).sum(), n, exact=True)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
        )
        self.head = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


@pytest.mark.parametrize("n", [2, 3])
def test_conv_batchnorm_eval(n):
    torch.manual_seed(0)
    model = ConvBN()
    with torch.no_grad():  # non-trivial running stats
        for bn in (model.body[1], model.body[4]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check(model, torch.randn(7, 3, 7, 7), lambda o: o.square().sum(), n, exact=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed in eval mode"


def test_batchnorm_train_running_stats_follow_first_replica():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(6, 3)
    ref = copy.deepcopy(bn)
    ref(x[:3])  # replica 0's chunk (6 rows over 2 devices: 3 + 3)
    data_parallel(bn, x, ["cpu", "cpu"])
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    assert bn.num_batches_tracked.item() == 1


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, batch, *, scale=1.0, mask=None):
        y = self.a(batch["x"]) + self.b(batch["z"][0]) * scale
        if mask is not None:
            y = y * mask
        return {"y": y, "parts": (self.a(batch["x"]), batch["tag"])}


@pytest.mark.parametrize("n", [2, 4])
def test_dict_inputs_kwargs_and_tuple_outputs(n):
    m = int_init(DictModel())
    batch = {"x": ints(6, 4), "z": (ints(6, 2, seed=3), "note"), "tag": "t"}
    mask = ints(6, 1, seed=4)
    out = check(
        m, batch, lambda o: o["y"].sum() + o["parts"][0].square().sum(), n,
        exact=True, kwargs={"scale": 2.0, "mask": mask},
    )
    assert out["parts"][1] == "t"


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.emb(tokens))))


@pytest.mark.parametrize("n", [2, 3])
def test_tied_weights(n):
    torch.manual_seed(0)
    tokens = torch.randint(0, 10, (5, 3))
    check(TiedLM(), tokens, lambda o: o.logsumexp(-1).sum(), n, exact=False)


class GradBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("gain", torch.tensor([1.0, -1.0, 2.0]).requires_grad_())

    def forward(self, x):
        return self.lin(x) * self.gain


def test_buffers_requiring_grad():
    m = int_init(GradBuffer())
    plain = copy.deepcopy(m)
    x = ints(5, 3)
    plain(x).sum().backward()
    data_parallel(m, x, ["cpu"] * 3).sum().backward()
    assert torch.equal(m.gain.grad, plain.gain.grad)


def test_dim1_scatter_and_gather():
    m = mlp()
    x = ints(2, 6, 4)  # batch along dim 1, a Linear over the last dim works either way
    check(m, x, lambda o: o.sum(), 3, exact=True, dim=1)


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = []  # plain attribute: shared by every replica (shallow copy)

    def forward(self, x):
        self.calls.append((x.shape[0], id(self)))
        return self.lin(x)


def test_fewer_rows_than_devices_uses_fewer_replicas():
    m = Recorder()
    out = data_parallel(m, torch.ones(3, 2), ["cpu"] * 4)
    assert sorted(c[0] for c in m.calls) == [1, 1, 1]
    assert out.shape == (3, 2)


def test_single_device_shortcut_calls_the_module_itself():
    m = Recorder()
    data_parallel(m, torch.ones(4, 2), ["cpu"])
    assert m.calls == [(4, id(m))]
    m.calls.clear()
    data_parallel(m, torch.ones(1, 2), ["cpu", "cpu"])  # one chunk -> shortcut too
    assert m.calls == [(1, id(m))]
    m.calls.clear()
    data_parallel(m, torch.ones(2, 2), ["cpu", "cpu"])
    assert [c[0] for c in m.calls] == [1, 1] and id(m) not in {c[1] for c in m.calls}


def test_scalar_outputs():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x).sum()

    assert data_parallel(Loss(), torch.ones(4, 2), ["cpu"] * 3).shape == (3,)
    assert data_parallel(Loss(), torch.ones(4, 2), ["cpu"]).shape == ()


def test_no_grad_output_and_no_graph():
    m = mlp()
    with torch.no_grad():
        out = data_parallel(m, ints(4, 4), ["cpu"] * 2)
    assert not out.requires_grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_default_devices_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        data_parallel(mlp(), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="devices=\\['cpu'"):
        DataParallel(mlp())


def test_DataParallel_module_state_dict_and_optimizer_step():
    m = mlp()
    plain = copy.deepcopy(m)
    dp = DataParallel(m, device_ids=["cpu"] * 3)
    assert dp.module is m
    assert list(dp.state_dict()) == ["module." + k for k in m.state_dict()]
    x, w = ints(6, 4), ints(6, 3, seed=5)
    opt_dp = torch.optim.SGD(dp.parameters(), lr=0.125)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.125)
    for _ in range(2):  # compare after every step
        for model, opt in ((dp, opt_dp), (plain, opt_plain)):
            opt.zero_grad()
            (model(x) * w).sum().backward()
            opt.step()
        for (name, p), q in zip(m.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_top_level_exports():
    # `refimpl.data_parallel` is the package whatever the import order (no name clash): the
    # function is `refimpl.data_parallel.data_parallel`, the module `refimpl.DataParallel`.
    # (Calling the package is 0.1.0's form, deprecated: tests/refimpl/test_public_api.py.)
    import types

    import refimpl.data_parallel as pkg

    assert isinstance(refimpl.data_parallel, types.ModuleType) and refimpl.data_parallel is pkg
    assert refimpl.DataParallel is DataParallel is pkg.DataParallel
    assert pkg.data_parallel is data_parallel
    x = ints(4, 4)
    m = mlp()
    assert torch.equal(refimpl.data_parallel.data_parallel(m, x, ["cpu", "cpu"]), data_parallel(m, x, ["cpu", "cpu"]))


def test_adapter_seam_positional_signature():
    m = mlp()
    out = data_parallel(m, (ints(4, 4),), ["cpu", "cpu"], "cpu", 0)
    assert out.shape == (4, 3)


def test_module_may_modify_its_input_in_place():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)  # legal outside data_parallel on an input that does not require grad
            return self.lin(x)

    m = int_init(InPlace())
    plain = copy.deepcopy(m)
    plain(ints(6, 4)).sum().backward()
    out = data_parallel(m, ints(6, 4), ["cpu"] * 3)
    out.sum().backward()
    torch.testing.assert_close(out, plain(ints(6, 4)), rtol=0, atol=0)
    for (name, p), q in zip(m.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
