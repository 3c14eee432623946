"""A local run listens on loopback only (see [Note: loopback] in conformance/harness/network.py).

The check reads the kernel's socket tables (/proc/net/tcp, /proc/net/tcp6) for every listening
socket held by the coordinator or a rank process, after the ranks joined a gloo group and
started TensorPipe RPC, and fails on any that is not loopback.
"""

import os
import socket
import sys

import pytest

from conformance.harness.network import listeners_of, loopback_env
from conformance.harness.pool import RankPool
from conformance.topology import choose_topology

linux_only = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")


@linux_only
def test_the_socket_reader_sees_a_listener_on_every_interface():
    """The check has teeth: a socket bound to all interfaces is found and is not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as wide, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lo:
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        lo.bind(("127.0.0.1", 0))
        lo.listen()
        mine = {s.port: s for s in listeners_of([os.getpid()])}
        assert not mine[wide.getsockname()[1]].loopback, mine
        assert mine[lo.getsockname()[1]].loopback, mine
    if socket.has_ipv6:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as wide6:
            wide6.bind(("::", 0))
            wide6.listen()
            found = {s.port: s for s in listeners_of([os.getpid()])}[wide6.getsockname()[1]]
            assert found.address == "::" and not found.loopback


def test_rank_processes_pin_gloo_and_tensorpipe_to_loopback():
    env = loopback_env()
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"]
    assert env["GLOO_SOCKET_IFNAME"] in {name for _, name in socket.if_nameindex()}


@linux_only
@pytest.mark.slow
@pytest.mark.xdist_group("network")
def test_a_local_pool_listens_on_loopback_only():
    pool = RankPool(choose_topology(2, "cpu"))
    try:
        outcome = pool.run("conformance.harness.probes:rpc_echo", 7, timeout=120)
        assert outcome.ok, outcome.render_failures()
        assert outcome.values == {0: 7, 1: 7}
        pids = [os.getpid(), *pool.pids]
        listeners = listeners_of(pids)
        report = ", ".join(f"{s}{'' if s.loopback else ' (NOT loopback)'}" for s in listeners)
        print(f"listening sockets of the coordinator and {len(pool.pids)} ranks (gloo + TensorPipe RPC): {report}",
              file=sys.stderr)
        assert listeners, "gloo and TensorPipe listen somewhere: finding no socket means the check is blind"
        wide = [str(s) for s in listeners if not s.loopback]
        assert not wide, f"listening beyond loopback: {wide}"
    finally:
        pool.close()


def _benchmark_world_listeners(rank, world, out):
    """A benchmark world's rank body: every listener this rank and the launcher (its parent: where a
    TCPStore server would live) hold after a gloo all-reduce."""
    import json

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    mine = [(str(s), s.loopback) for s in listeners_of([os.getpid()] + ([os.getppid()] if rank == 0 else []))]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(everyone, fh)


@linux_only
@pytest.mark.slow
@pytest.mark.xdist_group("network")
def test_benchmark_worlds_listen_on_loopback_only():
    """benchmarks/ddp_step_time.py's (and bucketer_time.py's) worlds: FileStore + gloo on loopback."""
    import importlib
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench)  # spawned ranks import the benchmark module by name
    try:
        ddp_step_time = importlib.import_module("ddp_step_time")
        per_rank = ddp_step_time.run_world(_benchmark_world_listeners, 2, timeout=300)
    finally:
        sys.path.remove(bench)
    print(f"listening sockets of a benchmark world, per rank: {per_rank}", file=sys.stderr)
    assert all(per_rank), "gloo listens somewhere: finding no socket means the check is blind"
    wide = [address for rank in per_rank for address, loopback in rank if not loopback]
    assert not wide, f"listening beyond loopback: {wide}"
