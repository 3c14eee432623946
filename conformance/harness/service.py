"""The rank service: the loop each warm rank process runs.

A rank joins the process group once (through a FileStore in the pool's private temp dir: no
port to race for under pytest-xdist, and no socket another host could reach; gloo and
TensorPipe are pinned to loopback, see harness/network.py), then serves tasks until told to
stop. Every task gets an explicit answer: a result, or an error with its traceback and the
stage it failed in ("setup": the task could not even be imported, an infrastructure problem;
"task": the implementation raised; "check": the group was left inconsistent after it).

Messages are pickled with the standard pickler (not torch's shared-memory reducer), so
tensors travel by value and nothing outlives the rank process that produced it.
"""

from __future__ import annotations

import enum
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta

STACK_SIGNAL = signal.SIGUSR1


class Op(str, enum.Enum):
    PHASE = "phase"  # a step of the start was reached (see [Note: start phases] in pool.py)
    READY = "ready"
    TASK = "task"
    RESULT = "result"
    ERROR = "error"
    STOP = "stop"
    STOPPED = "stopped"


def send(conn, **message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn) -> dict:
    return pickle.loads(conn.recv_bytes())


def _redirect_output(log_path: str) -> None:
    """Send the rank's stdout/stderr (C++ warnings included) to its log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(rank: int, topology, store_path: str, conn, workdir: str, rpc_init_method: str | None,
          environ: dict[str, str] | None = None) -> None:
    """Entry point of a spawned rank process; `environ` is the coordinator's environment when the
    world started (a rank forked from the fork server would otherwise see the server's)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    send(conn, op=Op.PHASE, rank=rank, phase="spawned")
    _redirect_output(os.path.join(workdir, f"rank{rank}.log"))
    faulthandler.enable(all_threads=False)  # a fatal signal leaves "Fatal Python error: ..." + the stack in the log
    from conformance.harness.network import pin_to_loopback

    pin_to_loopback()  # before torch.distributed creates a transport
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")  # noqa: SIM115 - lives with the process
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)

    import torch.distributed as dist

    from conformance.harness.context import RankContext, configure_rank_threads, resolve

    configure_rank_threads()
    send(conn, op=Op.PHASE, rank=rank, phase="imported torch")
    if topology.device == "cuda":  # first CUDA thing in the process (conformance/cuda_setup.py)
        import torch

        from conformance import cuda_setup
        from conformance.harness.network import loopback_interface

        cuda_setup.setup_process(backend=topology.backend, loopback=loopback_interface(),
                                 device=torch.device(topology.rank_device(rank)))  # local run: rank on node = rank
    store = dist.FileStore(store_path, topology.world_size)
    store.set_timeout(timedelta(seconds=120))
    send(conn, op=Op.PHASE, rank=rank, phase="joining the group (store and gloo/NCCL connect)")
    dist.init_process_group(
        topology.backend, store=store, rank=rank, world_size=topology.world_size, timeout=timedelta(minutes=10)
    )
    ctx = RankContext(rank, topology, dist.group.WORLD, rpc_init_method=rpc_init_method)
    send(conn, op=Op.READY, rank=rank, pid=os.getpid())
    run_loop(ctx, conn, resolve)
    # Tear down, then leave without running interpreter finalizers: gloo can abort at exit
    # ("terminate called without an active exception") after a successful run. The
    # coordinator has our STOPPED message by then, so it knows the work was done.
    try:
        dist.destroy_process_group()
    finally:
        send(conn, op=Op.STOPPED, rank=rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_loop(ctx, conn, resolve) -> None:
    """Serve tasks until STOP (or the coordinator goes away)."""
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):
            return
        if message["op"] == Op.STOP:
            return
        task_id = message["id"]
        stage = "setup"
        try:
            fn = resolve(message["fn"])
            ctx.bound_collectives(message.get("timeout"))
            stage = "task"
            with ctx.collective_check():
                value = fn(message["payload"], ctx)
            stage = "check"
            ctx.barrier_check(task_id)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the coordinator
            send(
                conn,
                op=Op.ERROR,
                id=task_id,
                rank=ctx.rank,
                stage=stage,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
            continue
        try:
            send(conn, op=Op.RESULT, id=task_id, rank=ctx.rank, value=value)
        except Exception as exc:  # unpicklable result
            send(conn, op=Op.ERROR, id=task_id, rank=ctx.rank, stage="task",
                 error=f"result not picklable: {exc}", traceback="")
