"""One CUDA setup for every process that computes on a GPU: the warm pool's rank processes, the
torchrun launcher's ranks and the coordinator that runs the oracle.

The suite judges fp32 at two ranks bitwise, which holds on a GPU only if both sides pick the
same kernels and none of them is nondeterministic. So, before CUDA initialises:

- ``torch.use_deterministic_algorithms(True, warn_only=True)``: deterministic kernels where
  torch has them (``warn_only``: an engine's op without one warns instead of raising, so the
  suite judges the values rather than failing the engine for torch's gap);
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS is deterministic only with a fixed workspace,
  read when its handle is created (hence before CUDA initialises);
- cuDNN: ``benchmark`` off (no per-shape algorithm search), ``deterministic`` on;
- TF32 off for matmuls and cuDNN (``allow_tf32 = False``; fp32 stays fp32), and the float32
  matmul precision "highest".

Each rank's device is its *local* rank's GPU (``LOCAL_RANK`` under torchrun: global rank 4 of
``--nnodes 2 --nproc-per-node 4`` is GPU 0 of its node), or GPU 0 when ranks share one.

NCCL (``nccl_env``): blocking wait, so a collective that never completes raises in the rank
after the group's timeout instead of spinning for ever (the rank sets that timeout from each
task's budget: ``conformance.harness.context``); and, where the whole run is on this machine
(the warm pool), NCCL's bootstrap and socket transport confined to loopback
(``NCCL_SOCKET_IFNAME``) with InfiniBand off, as gloo and TensorPipe are ([Note: loopback] in
conformance/harness/network.py). torchrun multi-node keeps NCCL's defaults: other hosts must
reach it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

import torch

__all__ = ["CUBLAS_WORKSPACE", "deterministic_flags", "local_device", "local_rank", "nccl_env", "pin_determinism",
           "setup_process"]

CUBLAS_WORKSPACE = ":4096:8"


def local_rank(env: Mapping[str, str] = os.environ, default: int | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun sets it), else ``default``."""
    value = env.get("LOCAL_RANK")
    if value is None:
        if default is None:
            raise ValueError("LOCAL_RANK is not set: run under torchrun, or give the local rank")
        return default
    return int(value)


def local_device(rank_on_node: int, shared_gpu: bool = False) -> torch.device:
    """The GPU of the rank ``rank_on_node`` of its node (GPU 0 when the ranks share one).

    Builds the device only: CUDA is not initialised here.
    """
    return torch.device("cuda", 0 if shared_gpu else rank_on_node)


def nccl_env(*, loopback: str | None) -> dict[str, str]:
    """NCCL's environment: blocking wait always; for a run on this machine (``loopback``: the
    loopback interface's name, ``conformance.harness.network.loopback_interface()``) its
    bootstrap and sockets on that interface and InfiniBand off."""
    env = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    if loopback is not None:
        env.update(NCCL_SOCKET_IFNAME=loopback, NCCL_IB_DISABLE="1")
    return env


def deterministic_flags() -> dict[str, object]:
    """The flags :func:`pin_determinism` sets, as they read now (a test and a report read them)."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def pin_determinism(env: MutableMapping[str, str] = os.environ) -> None:
    """Deterministic kernels, no TF32 (module docstring). Must run before CUDA initialises:
    cuBLAS reads its workspace setting when its first handle is made."""
    workspace = env.get("CUBLAS_WORKSPACE_CONFIG")
    if torch.cuda.is_initialized() and workspace not in (CUBLAS_WORKSPACE, ":16:8"):
        raise RuntimeError("CUDA was initialised before the suite's CUDA setup: call "
                           "conformance.cuda_setup.setup_process() first thing in the process")
    if workspace not in (CUBLAS_WORKSPACE, ":16:8"):  # the two settings cuBLAS documents as deterministic
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False  # the flags torch's newer fp32_precision reads too
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def setup_process(*, backend: str | None, loopback: str | None = None, device: torch.device | None = None,
                  env: MutableMapping[str, str] = os.environ) -> None:
    """Everything a process that computes on CUDA does first (module docstring): NCCL's
    environment (``backend="nccl"``; ``loopback`` for a run on this machine), determinism, then
    the current device (``device``: that initialises CUDA, so it comes last)."""
    if backend == "nccl":
        env.update(nccl_env(loopback=loopback))
    pin_determinism(env)
    if device is not None:
        torch.cuda.set_device(device)
