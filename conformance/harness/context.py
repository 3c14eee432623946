"""What a task sees inside a rank process: its `RankContext` (rank, topology, group, RPC).

Kept free of process management so that the spawn pool and the torchrun launcher hand the
same `RankContext` to the same task functions.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Where ranks run (`Topology`, `choose_topology`) is decided below the harness, in
# conformance/topology.py: the area registry and the pipeline ask it too.
from conformance.topology import Topology


@dataclass
class RankContext:
    """A rank's view of its world, passed explicitly to every task (no global state)."""

    rank: int
    topology: Topology
    group: Any  # the process group every collective of the task must use
    scratch: dict = field(default_factory=dict)  # per-process state kept across tasks
    rpc_init_method: str | None = None

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return torch.device(self.topology.rank_device(self.rank))

    @property
    def backend(self) -> str:
        return self.topology.backend

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
