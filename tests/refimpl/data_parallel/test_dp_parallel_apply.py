"""parallel_apply: threads, thread-local state, errors naming the replica, length checks."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from refimpl.data_parallel import ReplicaError, parallel_apply


class Probe(nn.Module):
    """Records what the worker thread sees, returns x * k."""

    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = k
        self.seen: dict = {}

    def forward(self, x, y=None, *, scale=1.0):
        self.seen = {
            "thread": threading.current_thread().name,
            "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
        }
        out = x * self.k * scale
        return out if y is None else out + y


def test_outputs_in_order_with_args_and_kwargs():
    mods = [Probe(k) for k in (1.0, 2.0, 3.0)]
    ones = torch.ones(2)
    out = parallel_apply(mods, [ones, (ones, ones), (ones,)], [{}, {"scale": 10.0}, {}], ["cpu"] * 3)
    assert [o.tolist() for o in out] == [[1.0, 1.0], [21.0, 21.0], [3.0, 3.0]]


def test_one_thread_per_replica_and_none_for_one():
    mods = [Probe() for _ in range(3)]
    parallel_apply(mods, [torch.ones(1)] * 3, devices=["cpu"] * 3)
    # names, not idents: idents are reused once a short-lived thread has ended
    assert [m.seen["thread"] for m in mods] == [f"parallel_apply-{i}" for i in range(3)]
    (single,) = [Probe()]
    parallel_apply([single], [torch.ones(1)])
    assert single.seen["thread"] == threading.current_thread().name


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference", "autocast"])
def test_thread_local_state_is_propagated(mode):
    mods = [Probe() for _ in range(2)]
    ctx = {
        "grad": torch.enable_grad(),
        "no_grad": torch.no_grad(),
        "inference": torch.inference_mode(),
        "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
    }[mode]
    with ctx:
        parallel_apply(mods, [torch.ones(1)] * 2, devices=["cpu", "cpu"])
    for m in mods:
        assert m.seen["grad"] == (mode in ("grad", "autocast"))
        assert m.seen["inference"] == (mode == "inference")
        assert m.seen["autocast"] == (mode == "autocast")


def test_autocast_dtype_reaches_replicas():
    lin = [nn.Linear(4, 4) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = parallel_apply(lin, [torch.ones(2, 4)] * 2, devices=["cpu", "cpu"])
    assert all(o.dtype == torch.bfloat16 for o in out)


class Boom(nn.Module):
    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        raise ValueError(f"boom after {self.delay}")


class Slow(nn.Module):
    finished = 0

    def forward(self, x):
        time.sleep(0.05)
        Slow.finished += 1
        return x


def test_exception_names_replica_and_device_and_keeps_cause():
    Slow.finished = 0
    mods = [Slow(), Slow(), Boom(), Slow()]
    with pytest.raises(ReplicaError, match=r"replica 2 on device cpu raised ValueError: boom") as info:
        parallel_apply(mods, [torch.ones(1)] * 4, devices=["cpu"] * 4)
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.replica_index == 2 and info.value.device == torch.device("cpu")
    assert Slow.finished == 3, "all replicas run to completion before the error is raised"


def test_first_exception_in_time_wins():
    mods = [Boom(delay=0.2), Boom(delay=0.0)]
    with pytest.raises(ReplicaError, match="replica 1"):
        parallel_apply(mods, [torch.ones(1)] * 2, devices=["cpu", "cpu"])


def test_single_replica_exception_is_wrapped_too():
    with pytest.raises(ReplicaError, match="replica 0 on device cpu") as info:
        parallel_apply([Boom()], [torch.ones(1)])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"inputs": [torch.ones(1)]}, "2 modules but 1 inputs"),
        ({"inputs": [torch.ones(1)] * 2, "kwargs": [{}]}, "2 modules but 1 kwargs"),
        ({"inputs": [torch.ones(1)] * 2, "devices": ["cpu"] * 3}, "2 modules but 3 devices"),
    ],
)
def test_length_mismatch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parallel_apply([Probe(), Probe()], **kwargs)


def test_empty():
    assert parallel_apply([], []) == []
