"""`torchft-ddp` / `torchft-ddp-async`: torchft's fault-tolerant DDP (`torchft.ddp.DistributedDataParallel`).

Each suite rank is one torchft replica group of size 1, as torchft's own examples run a
replica per process: a `Manager` per rank (with its `ManagerServer`), a lighthouse run by
rank 0, a torchft `ProcessGroupGloo` the Manager reconfigures at every quorum, and the model
and optimizer state registered with the Manager, which heals replicas from the primary at
step 0 (`init_sync=True`). The Manager owns the step: the optimizer is
`torchft.optim.OptimizerWrapper` (`zero_grad()` starts the next quorum, `step()` asks
`should_commit()` first), so the adapter owns the optimizer and calls `zero_grad()` once before
the first forward, as the user's loop does at the top of each iteration.

[Note: torchft on loopback] torchft's listeners default to every interface: the Manager binds
its server to `[::]`, the HTTP checkpoint transport to `("", 0)` over IPv6, and the replica
group's `TCPStore` server listens on every interface whatever host it is given. Here:
- the replica's TCPStore gets a listening socket bound to 127.0.0.1 (`master_listen_fd`);
- `ManagerServer` is constructed with `bind="127.0.0.1:0"` (torchft.manager's name is wrapped)
  and advertises `hostname="127.0.0.1"`; the lighthouse binds `127.0.0.1:0`;
- checkpoints travel over the process group (`PGTransport`), so no HTTP server starts;
- gloo is pinned to the loopback interface by the rank service (`GLOO_SOCKET_IFNAME`).
tests/conformance/test_torchft_adapter.py lists every listener of a 2-rank run and fails on
one that is not loopback.

Checkpoints go through `Wrapped.checkpoint_state` (`checkpoint_api`): the model's and the
optimizer's state dicts and the Manager's own (`Manager.state_dict()`: step and batches
committed, restored with `load_state_dict`), as torchft asks a checkpoint to carry.

Declared:
- buffers `construction-only`: torchft's DDP reduces over a one-rank dummy group (the Manager
  all-reduces gradients in its comm hook), so DDP's buffer broadcast reaches nobody; buffers are
  rank 0's once healed, then each rank's own (torchft/ddp.py: `ProcessGroupDummy(0, 1)`).
- `torchft-ddp` runs the Manager with `use_async_quorum=False`: healing is applied inside
  `start_quorum()`, before the first forward (construction sync eager, from the user's view).
- `torchft-ddp-async` runs torchft's default, `use_async_quorum=True`, declared
  `construction_sync: first-optimizer-step`: the quorum and the heal run during step 0 and the
  primary's (rank 0's) state is loaded at the first `should_commit()`, so every rank forwards and
  backwards step 0 from its own initial parameters; a healing replica does not participate
  (`Manager.allreduce` zeroes its gradient), so step 0's gradient is the participants' average:
  rank 0's own. Models with buffers are skipped (the heal's copy of the buffers races with the
  forward of step 0).
"""

from __future__ import annotations

import socket
from datetime import timedelta

from conformance.adapters.ddp_like import DDPLikeWrapped
from conformance.adapters.engines import probe
from conformance.adapters.feature_support import has_buffers
from conformance.adapters.protocol import OptimizerSpec
from conformance.semantics import Buffers, ConstructionSync, Semantics
from conformance.spec import Capability as C

INSTALL = "pip install -c constraints.txt 'gradparity[torchft]'  (torchft==0.2.*)"
TIMEOUT = timedelta(seconds=60)
# A quorum waits for every replica to reach it; after a rebuild in the same processes (checkpoint
# round trip, determinism repeat) the ranks arrive as fast as a loaded machine lets them rebuild:
# at load 40-60 on 2 cores one waited past 60 s (checkpoint-round-trip-scaler/w3). A real hang is
# still the harness's (case timeout), so the quorum's own deadline is generous.
QUORUM_TIMEOUT = timedelta(seconds=300)
SEMANTICS = Semantics(
    buffers=Buffers.CONSTRUCTION_ONLY,
    sources=("torchft/ddp.py: DistributedDataParallel passes ProcessGroupDummy(0, 1) to torch DDP and all-reduces "
             "gradients in a comm hook through the Manager, so DDP's buffer broadcast reaches no other replica; "
             "torchft/manager.py: init_sync heals replicas from the primary's state dict at step 0",),
)


def loopback_store():
    """A TCPStore server that listens on 127.0.0.1 only (torch's binds every interface)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), use_libuv=False)
    return store, port


def _loopback_manager_server():
    """torchft.manager builds its ManagerServer with bind=[::]:port: force 127.0.0.1."""
    import torchft.manager as manager_module

    real = getattr(manager_module.ManagerServer, "_gradparity_real", manager_module.ManagerServer)

    def loopback_server(**kwargs):
        return real(**{**kwargs, "bind": "127.0.0.1:0"})

    loopback_server._gradparity_real = real
    manager_module.ManagerServer = loopback_server


ASYNC_SEMANTICS = Semantics(
    construction_sync=ConstructionSync.FIRST_STEP,
    buffers=Buffers.CONSTRUCTION_ONLY,
    sources=(*SEMANTICS.sources,
             "torchft/manager.py: with use_async_quorum (the default) the pending state dict is applied in "
             "should_commit(); Manager.allreduce zeroes the gradient of a replica that is not participating "
             "(healing) and divides by num_participants()"),
)


POST_DIVIDE_SOURCE = ("torchft/manager.py Manager.allreduce: ReduceOp.AVG is an all-reduce SUM, then "
                      "`tensor /= num_participants` (1/W after the sum, not on every share as torch DDP)")


def _post_divide(semantics: Semantics, scenario) -> Semantics:
    """The cross-rank sum divided after summing: the scenario's rule with 1/W placed "post".

    Carried in `lossy` (the field that replaces the scenario's rule): nothing is lossy, the
    envelope of summation orders is the same, with the division where torchft does it.
    """
    from dataclasses import replace

    tol = scenario.tolerance
    if scenario.world_size <= 2 or tol.kind != "summation-order":
        return semantics  # at 2 ranks (a + b) / 2 == a/2 + b/2 bitwise
    rule = replace(tol, divide=("post",), reason=f"{tol.reason}; torchft divides after the sum")
    return replace(semantics, lossy=rule, sources=(*semantics.sources, POST_DIVIDE_SOURCE))


class TorchFTWrapped(DDPLikeWrapped):
    def __init__(self, ddp, manager, lighthouse, store):
        super().__init__(ddp)
        self.manager, self._lighthouse, self._store = manager, lighthouse, store

    def backward_stats(self):
        return None

    def clip_grad_norm_(self, max_norm: float) -> None:
        # Every replica holds the all-reduced gradients: torch's global clip, before the wrapper's step.
        import torch

        torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], max_norm)

    def checkpoint_state(self) -> dict:
        """torchft's checkpoint: the user's state (model, optimizer) and the Manager's own
        (`Manager.state_dict()`: step, batches committed), which torchft says to save with it."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.optim.state_dict(),
                "torchft": self.manager.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.optim.load_state_dict(state["optimizer"])
        self.manager.load_state_dict(state["torchft"])

    def close(self) -> None:
        """Stop the Manager's server and (rank 0) the lighthouse: nothing listens after the case."""
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
        self._store = None


class TorchFTAdapter:
    area = "ddp"
    owns = frozenset({"optimizer"})
    ddp_module = True
    checkpoint_api = True  # Wrapped.checkpoint_state: model, optimizer and the Manager's state_dict
    capabilities = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.BUFFER_BROADCAST})
    semantics = SEMANTICS

    def __init__(self, use_async_quorum: bool):
        self.use_async_quorum = use_async_quorum
        self._semantics = ASYNC_SEMANTICS if use_async_quorum else SEMANTICS
        self.name = "torchft-ddp-async" if use_async_quorum else "torchft-ddp"
        self.version, self._why = probe("torchft", "torchft", INSTALL)

    def semantics_for(self, scenario) -> Semantics:
        return _post_divide(self._semantics, scenario)

    def unavailable(self, scenario) -> str | None:
        if self._why:
            return self._why
        if scenario.optimizer == "none":
            return "torchft's Manager commits a step through the optimizer wrapper: it needs an optimizer"
        if self.use_async_quorum and has_buffers(scenario):
            return "async quorum: the heal's copy of rank 0's buffers races with step 0's forward (not modelled)"
        if scenario.dtype != "float32":
            return "torchft's ProcessGroupGloo is driven with fp32 gradients here"
        return None

    def wrap(self, module, ctx, options, optimizer: OptimizerSpec | None = None) -> TorchFTWrapped:
        import torch
        import torch.distributed as dist
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.coordination import LighthouseServer
        from torchft.ddp import DistributedDataParallel
        from torchft.manager import Manager
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo

        _loopback_manager_server()
        # A replica is dropped from the quorum after heartbeat_timeout_ms without a heartbeat (5 s by default):
        # on a loaded CI machine a starved heartbeat thread would read as a failure, so allow the op timeout.
        lighthouse = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=ctx.world_size, heartbeat_timeout_ms=int(TIMEOUT.total_seconds() * 1000),
        ) if ctx.rank == 0 else None
        address = [lighthouse.address() if lighthouse is not None else None]
        dist.broadcast_object_list(address, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
        store, port = loopback_store()
        inner = optimizer.build([p for p in module.parameters() if p.requires_grad])
        pg = ProcessGroupGloo(timeout=TIMEOUT)

        def state_dict():
            return {"model": module.state_dict(), "optimizer": inner.state_dict()}

        def load_state_dict(state):
            module.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])

        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=ctx.world_size,
            use_async_quorum=self.use_async_quorum, rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
            lighthouse_addr=address[0], replica_id=f"gradparity_{ctx.rank}", hostname="127.0.0.1",
            checkpoint_transport=PGTransport(pg, TIMEOUT, torch.device("cpu")), timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT,
        )
        ddp = DistributedDataParallel(manager, module)
        wrapped = TorchFTWrapped(ddp, manager, lighthouse, store)
        wrapped.optimizer = OptimizerWrapper(manager, inner)
        wrapped.optimizer.zero_grad()  # the top of the user's first iteration: starts (sync: and heals) quorum 0
        return wrapped


def torchft_ddp() -> TorchFTAdapter:
    return TorchFTAdapter(use_async_quorum=False)


def torchft_ddp_async() -> TorchFTAdapter:
    return TorchFTAdapter(use_async_quorum=True)
