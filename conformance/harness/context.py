"""What a task sees inside a rank process, and how a backend is chosen for a device.

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


@dataclass(frozen=True)
class Topology:
    """Where ranks run and how they talk: chosen once per pool."""

    world_size: int
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    shared_gpu: bool = False  # ranks share cuda:0 (gloo with CUDA tensors)

    def rank_device(self, rank: int) -> str:
        if self.device == "cpu":
            return "cpu"
        return "cuda:0" if self.shared_gpu else f"cuda:{rank}"

    def key(self) -> str:
        gpu = "/shared-gpu" if self.shared_gpu else ""
        return f"w{self.world_size}/{self.backend}/{self.device}{gpu}"


def choose_topology(world_size: int, device: str, backend: str = "auto") -> Topology:
    """gloo on CPU; NCCL when every rank has its own GPU; gloo with CUDA tensors otherwise."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cpu":
        if backend not in ("auto", "gloo"):
            raise ValueError(f"backend {backend!r} cannot run CPU tensors; use gloo")
        return Topology(world_size, "gloo", "cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch.cuda.is_available() is False")
    own_gpus = torch.cuda.device_count() >= world_size
    if backend == "auto":
        backend = "nccl" if own_gpus else "gloo"
    if backend == "nccl" and not own_gpus:
        raise ValueError(f"NCCL needs one GPU per rank: world size {world_size}, {torch.cuda.device_count()} GPUs")
    return Topology(world_size, backend, "cuda", shared_gpu=not own_gpus)


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
