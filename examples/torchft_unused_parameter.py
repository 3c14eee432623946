"""A parameter used on some ranks only: torch DDP averages it on every rank, torchft's DDP lets ranks diverge.

Standalone (torch + torchft 0.2, CPU, two processes, loopback only):

    python examples/torchft_unused_parameter.py

torchft.ddp.DistributedDataParallel hands torch DDP a one-rank ProcessGroupDummy and all-reduces
each bucket through its Manager. With find_unused_parameters=True (which it forces), each rank's
reducer decides "unused" from its own one-rank group: a parameter rank 1 did not use keeps
grad None on rank 1, while rank 0 gets the all-reduced average. After optimizer.step() the ranks
hold different parameters, and nothing reports it. torch DDP (same model, same data) gives both
ranks the same averaged gradient. See docs/findings/torchft-unused-parameter.md.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Linear(4, 4)  # used on rank 0 only

    def forward(self, x, rank):
        y = self.shared(x)
        return self.extra(y) if rank == 0 else y


def _torchft_ddp(model, rank, world):
    import torchft.manager as tm
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.coordination import LighthouseServer
    from torchft.ddp import DistributedDataParallel
    from torchft.process_group import ProcessGroupGloo

    real = tm.ManagerServer  # every torchft listener on 127.0.0.1 (its defaults bind all interfaces)
    tm.ManagerServer = lambda **kw: real(**{**kw, "bind": "127.0.0.1:0"})
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world) if rank == 0 else None
    address = [lighthouse.address() if lighthouse else None]
    dist.broadcast_object_list(address, src=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), use_libuv=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    manager = tm.Manager(
        pg=pg, load_state_dict=model.load_state_dict, state_dict=model.state_dict, min_replica_size=world,
        use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
        lighthouse_addr=address[0], replica_id=f"demo_{rank}", hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timedelta(seconds=60), torch.device("cpu")),
    )
    manager.start_quorum()  # quorum 0: rank 0's weights reach every replica
    return DistributedDataParallel(manager, model), (manager, lighthouse, store)


def run(rank, world, store_path, queue):
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    out = {}
    for engine in ("torch DDP", "torchft DDP"):
        torch.manual_seed(0)
        model = Net()
        keep = None
        if engine == "torch DDP":
            ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        else:
            ddp, keep = _torchft_ddp(model, rank, world)
        ddp(torch.full((2, 4), float(rank + 1)), rank).sum().backward()
        grad = model.extra.weight.grad
        out[engine] = None if grad is None else grad.sum().item()
        if keep is not None:
            keep[0].shutdown(wait=False)
            if keep[1] is not None:
                keep[1].shutdown()
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run, args=(r, 2, os.path.join(tmp, "store"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=180) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    for engine in ("torch DDP", "torchft DDP"):
        values = {r: results[r][engine] for r in sorted(results)}
        verdict = "same on every rank" if len(set(values.values())) == 1 else "RANKS DIVERGE"
        print(f"{engine:12s} extra.weight.grad.sum() per rank: {values}  -> {verdict}")
