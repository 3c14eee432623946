"""In-process tests of the reducer's state machine and the DDP wrapper (world size 1, gloo).

World size 1 runs the same code path as N (buckets, async all-reduce, finalize), so these
catch most logic errors without spawning; the multi-rank behaviour is in test_ddp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refimpl import DistributedDataParallel as DDP
from refimpl.ddp.reducer import ReducerState


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_unsupported_keywords_are_rejected_before_anything_else():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        DDP(net(), bogus=1)
    with pytest.raises(ValueError, match="does not support skip_all_reduce_unused_params"):
        DDP(net(), skip_all_reduce_unused_params=True)


def test_state_transitions_and_grads(world1):
    ref = net()
    ddp = DDP(net(), process_group=world1)
    r = ddp.reducer
    assert r.state is ReducerState.IDLE
    x = torch.randn(3, 4)
    out = ddp(x)
    assert r.state is ReducerState.PREPARED
    out.sum().backward()
    assert r.state is ReducerState.IDLE
    ref(x).sum().backward()
    for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    stats = ddp.get_backward_stats()
    assert len(stats.param_ready_ns) == 4 and all(t is not None for t in stats.param_ready_ns)
    assert stats.as_dict()["buckets"][0]["launch_ns"] is not None


def test_no_sync_forward_does_not_prepare_and_accumulates(world1):
    ddp = DDP(net(), process_group=world1)
    x = torch.randn(3, 4)
    with ddp.no_sync():
        ddp(x).sum().backward()
        assert ddp.reducer.state is ReducerState.IDLE
    first = [p.grad.clone() for p in ddp.parameters()]
    ddp(x).sum().backward()
    for p, g in zip(ddp.parameters(), first, strict=True):
        assert torch.allclose(p.grad, 2 * g)


def test_forward_without_backward_then_forward_is_fine(world1):
    ddp = DDP(net(), process_group=world1)
    ddp(torch.randn(3, 4))
    ddp(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        ddp(torch.randn(3, 4))
    assert ddp.reducer.state is ReducerState.IDLE


def test_unused_parameter_raises_at_end_of_backward_and_resets(world1):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    ddp = DDP(Two(), process_group=world1)
    with pytest.raises(RuntimeError, match=r"(?s)unused\.weight.*find_unused_parameters=True"):
        ddp(torch.randn(3, 4)).sum().backward()
    assert ddp.reducer.state is ReducerState.IDLE
    ddp2 = DDP(Two(), process_group=world1, find_unused_parameters=True)
    ddp2(torch.randn(3, 4)).sum().backward()
    assert ddp2.module.unused.weight.grad is None and ddp2.module.used.weight.grad is not None


def test_comm_hook_registration_rules(world1):
    from refimpl.ddp.comm_hooks import fp16_compress_hook

    ddp = DDP(net(), process_group=world1)
    ddp.register_comm_hook(world1, fp16_compress_hook)
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    ref = net()
    ref(x).sum().backward()
    for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(world1, fp16_compress_hook)


def test_hooks_fired_from_two_threads_launch_every_bucket_once(world1, monkeypatch):
    """[Note: hooks from several threads] in reducer.py: torch runs one autograd thread per
    device, so a module spread over two GPUs gets its hooks from two threads. Here two threads
    fire the hooks of interleaved parameters at once, against a group that counts each bucket's
    all-reduces; a ready count read by one thread and written by the other (forced by a counter
    that lets the other thread run between its read and its write) would lose a decrement, and a
    bucket would never launch, or launch twice."""
    import threading
    import time

    import torch.distributed as dist

    from refimpl.ddp import reducer as reducer_module
    from refimpl.ddp.buckets import Bucket

    slot = Bucket.__dict__["pending"]  # the __slots__ member

    def slow_pending(b):  # read, let the other thread run, then hand back what was read
        value = slot.__get__(b)
        time.sleep(0)
        return value

    monkeypatch.setattr(Bucket, "pending", property(slow_pending, slot.__set__))
    launches: dict[int, int] = {}
    original = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        launches[tensor.data_ptr()] = launches.get(tensor.data_ptr(), 0) + 1
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    queued = []
    monkeypatch.setattr(reducer_module.compat, "queue_backward_callback", queued.append)  # no autograd here

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(32)])
    ddp = DDP(model, process_group=world1, bucket_cap_mb=4 * 4 * 4 * 8 / 2**20)  # 8 parameters a bucket
    r = ddp.reducer
    assert len(r.plan) == 4
    params = list(model.parameters())
    for iteration in range(5):
        grads = [torch.full((4, 4), float(iteration * 100 + k)) for k in range(len(params))]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        launches.clear()
        r.prepare_for_backward()
        start = threading.Barrier(2)
        errors = []

        def fire(indices, start=start, errors=errors):
            start.wait()
            try:
                for i in indices:
                    r.grad_ready(i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=fire, args=(range(k, len(params), 2),)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(queued) == 1, f"iteration {iteration}: finalize queued {len(queued)} times"
        queued.pop()()  # backward's end: finalize
        assert sorted(launches.values()) == [1] * len(r.plan), f"iteration {iteration}: launches per bucket {launches}"
        assert r.state is ReducerState.IDLE
        for p, g in zip(params, grads, strict=True):
            assert torch.equal(p.grad, g)  # world size 1: the average is the gradient
