"""scatter / gather: chunk sizes, nesting, pass-through of non-tensors, autograd."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from refimpl.data_parallel import balanced_chunk_sizes, gather, scatter, scatter_kwargs

Pair = namedtuple("Pair", "a b")
CPU4 = ["cpu"] * 4


@pytest.mark.parametrize(
    "length,n,expected",
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (5, 4, [2, 1, 1, 1]), (3, 4, [1, 1, 1]), (1, 3, [1]), (0, 3, [0]), (7, 1, [7])],
)
def test_balanced_chunk_sizes(length, n, expected):
    assert balanced_chunk_sizes(length, n) == expected
    if length:
        parts = torch.tensor_split(torch.arange(length), min(n, length))
        assert [len(p) for p in parts] == expected, "documented as tensor_split sizes"


def test_scatter_tensor_matches_tensor_split():
    x = torch.arange(20.0).reshape(10, 2)
    chunks = scatter(x, CPU4)
    assert len(chunks) == 4
    for c, ref in zip(chunks, torch.tensor_split(x, 4), strict=True):
        assert torch.equal(c, ref)
        assert c.data_ptr() != ref.data_ptr(), "same-device chunks are copies"


def test_scatter_dim_and_negative_dim():
    x = torch.arange(24.0).reshape(2, 3, 4)
    for dim in (1, -2):
        chunks = scatter(x, ["cpu"] * 2, dim=dim)
        assert [c.shape[1] for c in chunks] == [2, 1]
        assert torch.equal(torch.cat(chunks, 1), x)


def test_scatter_nested_with_non_tensors():
    x, y = torch.arange(6.0), torch.arange(12.0).reshape(6, 2)
    flag = object()
    inputs = (x, [y, "tag", 3], {"y": y, "opt": None, "cfg": flag}, Pair(x, 1.5), OrderedDict(z=x), (), {})
    out = scatter(inputs, CPU4)
    sizes = [2, 2, 1, 1]
    assert len(out) == 4
    for j, chunk in enumerate(out):
        cx, (cy, tag, three), d, pair, od, empty_t, empty_d = chunk
        assert isinstance(chunk, tuple) and isinstance(chunk[1], list)
        assert cx.shape[0] == sizes[j] and cy.shape == (sizes[j], 2)
        assert (tag, three) == ("tag", 3)
        assert d["opt"] is None and d["cfg"] is flag and torch.equal(d["y"], cy)
        assert isinstance(pair, Pair) and pair.b == 1.5 and torch.equal(pair.a, cx)
        assert isinstance(od, OrderedDict) and torch.equal(od["z"], cx)
        assert empty_t == () and empty_d == {}


def test_scatter_keeps_mapping_subclass():
    d = defaultdict(list, {"x": torch.ones(4)})
    out = scatter(d, ["cpu"] * 2)
    assert all(isinstance(o, defaultdict) and o.default_factory is list for o in out)


def test_scatter_without_tensors_gives_one_chunk():
    assert scatter(("a", 1), CPU4) == [("a", 1)]


def test_scatter_rejects_inconsistent_chunk_counts_and_scalars():
    with pytest.raises(ValueError, match="different numbers of chunks"):
        scatter((torch.ones(8), torch.ones(2)), CPU4)
    with pytest.raises(ValueError, match="0-dim"):
        scatter((torch.ones(8), torch.tensor(1.0)), CPU4)
    with pytest.raises(ValueError, match="along dim 2"):
        scatter(torch.ones(3, 3), CPU4, dim=2)


def test_scatter_explicit_chunk_sizes():
    out = scatter(torch.arange(6), ["cpu"] * 3, chunk_sizes=[1, 5])
    assert [o.tolist() for o in out] == [[0], [1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="chunk_sizes"):
        scatter(torch.arange(6), ["cpu"] * 3, chunk_sizes=[1, 2])


def test_scatter_kwargs_same_count():
    args, kwargs = scatter_kwargs((torch.ones(3),), {"mask": torch.zeros(3), "mode": "x"}, CPU4)
    assert len(args) == len(kwargs) == 3
    assert all(kw["mode"] == "x" and kw["mask"].shape == (1,) for kw in kwargs)
    args, kwargs = scatter_kwargs((), {"m": torch.zeros(4)}, ["cpu"] * 2)
    assert args == [(), ()] and [k["m"].shape[0] for k in kwargs] == [2, 2]


def test_gather_round_trip_nested():
    x, y = torch.randn(7, 3), torch.randn(7)
    inputs = {"x": x, "pair": Pair(y, "keep"), "lst": [x, None]}
    back = gather(scatter(inputs, CPU4), "cpu")
    assert torch.equal(back["x"], x) and torch.equal(back["pair"].a, y)
    assert back["pair"].b == "keep" and isinstance(back["pair"], Pair)
    assert torch.equal(back["lst"][0], x) and back["lst"][1] is None


def test_gather_dim1_scalars_and_non_tensors():
    parts = [torch.ones(2, 1), 2 * torch.ones(2, 3)]
    assert gather(parts, "cpu", dim=1).shape == (2, 4)
    assert torch.equal(gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu"), torch.tensor([1.0, 2.0]))
    assert gather([3, 3], "cpu") == 3
    assert gather([3, 4], "cpu") == [3, 4]


def test_gather_structure_mismatch_raises():
    with pytest.raises(ValueError, match="replica 1"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], "cpu")
    with pytest.raises(ValueError, match="replica 1"):
        gather([(torch.ones(1),), (torch.ones(1), torch.ones(1))], "cpu")
    with pytest.raises(TypeError):
        gather([torch.ones(1), None], "cpu")


def test_scatter_gather_autograd():
    x = torch.randn(5, 2, requires_grad=True)
    w = torch.arange(10.0).reshape(5, 2)
    chunks = scatter(x, CPU4)
    gather([c * 2 for c in chunks], "cpu").mul(w).sum().backward()
    assert torch.equal(x.grad, 2 * w)


def test_scatter_backward_with_unused_chunk_is_zero_there():
    x = torch.randn(4, 2, requires_grad=True)
    a, b = scatter(x, ["cpu", "cpu"])
    a.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 1], [1, 1], [0, 0], [0, 0]]))


def test_gather_backward_scatters_grad_and_scalars():
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    v = gather([a * 1, b * 1], "cpu")
    (v * torch.tensor([5.0, 7.0])).sum().backward()
    assert a.grad.shape == () and a.grad.item() == 5.0 and b.grad.item() == 7.0
