"""conformance/cuda_setup.py and its callers, as far as a CPU can check them: the flags and
environment it sets (before CUDA initialises), the device each rank picks (from LOCAL_RANK, a
2-node torchrun world included), the NCCL timeout bound to a task's budget, and that the rank
processes, the torchrun launcher and the oracle's process all call it.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from conformance import cuda_setup
from conformance.harness.context import NCCL_TIMEOUT_MARGIN_S, RankContext
from conformance.topology import Topology

ROOT = Path(__file__).resolve().parents[2]

_PIN = """
import os, torch
from conformance import cuda_setup
os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
cuda_setup.pin_determinism()
flags = cuda_setup.deterministic_flags()
flags["cuda initialised"] = torch.cuda.is_initialized()
print(sorted(flags.items()))
"""


def test_pin_determinism_sets_every_flag_without_initialising_cuda():
    out = subprocess.run([sys.executable, "-c", _PIN], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert dict(eval(out.stdout)) == {  # noqa: S307 - our own subprocess's repr
        "deterministic_algorithms": True, "deterministic_warn_only": True, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "cudnn.benchmark": False, "cudnn.deterministic": True, "matmul.allow_tf32": False,
        "cudnn.allow_tf32": False, "float32_matmul_precision": "highest", "cuda initialised": False,
    }


def test_pin_determinism_refuses_once_cuda_is_initialised_without_the_workspace(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialised before the suite's CUDA setup"):
        cuda_setup.pin_determinism({})


def test_nccl_gets_blocking_wait_and_loopback_only_for_a_local_run(monkeypatch):
    monkeypatch.setattr(cuda_setup, "pin_determinism", lambda env: None)  # flags: the test above
    local, multi_node, gloo = {}, {}, {}
    cuda_setup.setup_process(backend="nccl", loopback="lo", env=local)
    cuda_setup.setup_process(backend="nccl", loopback=None, env=multi_node)
    cuda_setup.setup_process(backend="gloo", loopback="lo", env=gloo)
    assert local == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    assert multi_node == {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert gloo == {}


def _two_node_env(global_rank: int) -> dict[str, str]:
    """torchrun --nnodes 2 --nproc-per-node 4: global rank 4 is local rank 0 of the second node."""
    return {"RANK": str(global_rank), "LOCAL_RANK": str(global_rank % 4), "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": str(global_rank // 4)}


def test_torchrun_ranks_use_their_local_gpu_on_two_nodes(monkeypatch):
    from conformance.frontends import torchrun

    calls = []
    monkeypatch.setattr(cuda_setup, "setup_process", lambda **kw: calls.append(kw))
    env = _two_node_env(4)
    device, backend, local_rank = torchrun.setup_rank(env, cuda_available=True)
    assert (device, backend, local_rank) == ("cuda", "nccl", 0)
    assert calls == [{"backend": "nccl", "loopback": None, "device": torch.device("cuda", 0), "env": env}]
    ctx = RankContext(4, Topology(8, "nccl", "cuda"), None, local_rank=local_rank)
    assert ctx.device == torch.device("cuda", 0)  # not cuda:4: that node has GPUs 0-3


def test_a_one_node_torchrun_world_keeps_nccl_on_loopback(monkeypatch):
    from conformance.frontends import torchrun
    from conformance.harness.network import loopback_interface

    calls = []
    monkeypatch.setattr(cuda_setup, "setup_process", lambda **kw: calls.append(kw))
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert torchrun.setup_rank(env, cuda_available=True) == ("cuda", "nccl", 1)
    assert calls[0]["loopback"] == loopback_interface() and calls[0]["device"] == torch.device("cuda", 1)
    assert torchrun.setup_rank(env, cuda_available=False) == ("cpu", "gloo", 1) and len(calls) == 1


def test_a_pool_rank_uses_the_gpu_of_its_rank_or_the_shared_one():
    assert RankContext(1, Topology(2, "nccl", "cuda"), None).device == torch.device("cuda", 1)
    assert RankContext(1, Topology(2, "gloo", "cuda", shared_gpu=True), None).device == torch.device("cuda", 0)


def test_nccl_collectives_are_bounded_by_the_task_budget(monkeypatch, world1):
    from refimpl import _torch_compat as compat

    compat.set_group_timeout(world1, timedelta(seconds=1800))  # the pin: works on a gloo group too
    calls = []
    monkeypatch.setattr(compat, "set_group_timeout", lambda group, timeout: calls.append((group, timeout)))
    RankContext(0, Topology(1, "nccl", "cuda"), world1).bound_collectives(60.0)
    RankContext(0, Topology(1, "gloo", "cpu"), world1).bound_collectives(60.0)
    RankContext(0, Topology(1, "nccl", "cuda"), world1).bound_collectives(None)
    assert calls == [(world1, timedelta(seconds=60.0 + NCCL_TIMEOUT_MARGIN_S))]


def test_the_oracles_process_sets_cuda_up_before_a_cuda_case(monkeypatch):
    from conformance import catalogue, pipeline
    from conformance.case import Case

    calls = []
    monkeypatch.setattr(cuda_setup, "setup_process", lambda **kw: calls.append(kw))

    class Executor:
        def run(self, area, scenario, spec):
            return ("ran", scenario.device)

    scenario = next(s for s in catalogue.all_scenarios() if s.area == "ddp")
    for device in ("cpu", "cuda"):
        assert pipeline._run(Case(catalogue.on_device(scenario, device), "refimpl-ddp"), Executor()) == ("ran", device)
    assert calls == [{"backend": None}]  # once, for the CUDA case only
