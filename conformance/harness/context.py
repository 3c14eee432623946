"""What a task sees inside a rank process: its `RankContext` (rank, topology, group, RPC).

Kept free of process management so that the spawn pool and the torchrun launcher hand the
same `RankContext` to the same task functions.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Where ranks run (`Topology`, `choose_topology`) is decided below the harness, in
# conformance/topology.py: the area registry and the pipeline ask it too.
from conformance.topology import Topology
from refimpl import _torch_compat as compat

CHECK_DEVICES_ENV = "GRADPARITY_CHECK_DEVICES"  # see RankContext.collective_check
NCCL_TIMEOUT_MARGIN_S = 30.0  # past a task's budget, before its NCCL collectives raise (bound_collectives)


@dataclass
class RankContext:
    """A rank's view of its world, passed explicitly to every task (no global state)."""

    rank: int
    topology: Topology
    group: Any  # the process group every collective of the task must use
    scratch: dict = field(default_factory=dict)  # per-process state kept across tasks
    rpc_init_method: str | None = None
    local_rank: int | None = None  # the rank on its node (torchrun's LOCAL_RANK); None: the rank (a local pool)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        """This rank's device: on CUDA its *node-local* rank's GPU (conformance/cuda_setup.py)."""
        return torch.device(self.topology.rank_device(self.rank if self.local_rank is None else self.local_rank))

    @property
    def backend(self) -> str:
        return self.topology.backend

    def bound_collectives(self, budget_s: float | None) -> None:
        """On NCCL, a collective of the next task that never completes raises ``budget_s`` +
        ``NCCL_TIMEOUT_MARGIN_S`` later (blocking wait: conformance/cuda_setup.py) instead of
        spinning for ever; the margin lets the pool's watchdog, which acts at the budget with
        every rank's stack, come first. gloo checks sizes and aborts on its own."""
        if budget_s is None or self.backend != "nccl":
            return
        compat.set_group_timeout(self.group, timedelta(seconds=budget_s + NCCL_TIMEOUT_MARGIN_S))

    def collective_check(self):
        """The device check a task runs under (refimpl.device_check): every tensor a collective
        is given must be on this rank's device. On NCCL always (a CPU tensor fails there anyway;
        the check names the line); elsewhere when ``GRADPARITY_CHECK_DEVICES`` is ``1``, or
        ``stand-in`` (CPU tests: device-less factories build on 'meta', [Note: the CPU stand-in])."""
        from refimpl.device_check import expect_collective_device

        mode = os.environ.get(CHECK_DEVICES_ENV, "")
        if mode == "stand-in":
            return expect_collective_device(self.device, stray="meta")
        if mode == "1" or self.backend == "nccl":
            return expect_collective_device(self.device)
        return contextlib.nullcontext()

    def ensure_rpc(self) -> None:
        """Start torch.distributed.rpc once per rank process (workers named worker<rank>)."""
        if self.scratch.get("rpc"):
            return
        from torch.distributed import rpc

        if self.rpc_init_method is None:
            raise RuntimeError("this launcher did not provide an RPC rendezvous")
        options = rpc.TensorPipeRpcBackendOptions(init_method=self.rpc_init_method, rpc_timeout=60)
        rpc.init_rpc(f"worker{self.rank}", rank=self.rank, world_size=self.world_size, rpc_backend_options=options)
        self.scratch["rpc"] = True

    def barrier_check(self, token: int) -> None:
        """Prove the group is still consistent after a task: a collective with a known result.

        An implementation that leaves a collective pending (launched on some ranks only)
        would make this mismatch or hang; the pool then replaces the group, so one broken
        task never poisons the next.
        """
        t = torch.tensor([float(token), 1.0], device=self.device)
        dist.all_reduce(t, group=self.group)
        expected = [float(token) * self.world_size, float(self.world_size)]
        if t.tolist() != expected:
            raise RuntimeError(
                f"rank {self.rank}: process group inconsistent after the task "
                f"(check all_reduce gave {t.tolist()}, expected {expected}): a collective was left pending"
            )


def resolve(ref: str):
    """Import 'pkg.module:attr'."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def configure_rank_threads() -> None:
    """One intra-op thread per rank: ranks share few cores, and results must not depend on it."""
    torch.set_num_threads(int(os.environ.get("GRADPARITY_RANK_THREADS", "1")))
