"""The network surface of a local run: loopback only, and a way to prove it.

[Note: loopback]
A local pool has no reason to be reachable from another machine, yet torch's defaults make it
so: `TCPStore(host, ...)` as master listens on every interface whatever `host` says (torch
2.13, pytorch/pytorch#173909), and gloo and TensorPipe bind the address the hostname resolves to (a LAN
address on many CI hosts). The pool therefore
- rendezvouses through a `FileStore` in its private (0700) temp dir: no socket at all;
- pins gloo (`GLOO_SOCKET_IFNAME`) and TensorPipe (`TP_SOCKET_IFNAME`) to the loopback
  interface in every rank process before torch.distributed starts;
- on CUDA pools, confines NCCL too (`NCCL_SOCKET_IFNAME`, InfiniBand off: conformance/cuda_setup.py).
torchrun multi-node keeps torch's behaviour on purpose: ranks on other hosts must reach it.

`listening_sockets()` reads /proc/net/tcp{,6} so a test can fail on any listener of the run
that is not loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

TCP_LISTEN = "0A"


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS/BSD)."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), "lo")


def loopback_env() -> dict[str, str]:
    """Environment that keeps gloo and TensorPipe on the loopback interface."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "TP_SOCKET_IFNAME": lo}


def pin_to_loopback() -> None:
    """Call in a rank process before torch.distributed creates any transport."""
    os.environ.update(loopback_env())


def join_local_group(store_path: str, rank: int, world_size: int, *, timeout, backend: str = "gloo") -> None:
    """Join a process group of local ranks with no listener off loopback ([Note: loopback]).

    `store_path` is a file in a private (0700) temp dir the launcher made, e.g. inside
    `tempfile.TemporaryDirectory()`; every rank of the world passes the same path.
    Benchmarks and test worlds use it; the warm pool's ranks do the same in `service.serve`.
    """
    pin_to_loopback()  # before torch.distributed creates a transport
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    inode: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


def _decode(hex_addr: str) -> str:
    """/proc/net/tcp stores addresses as host-order 32-bit words in hex."""
    raw = bytes.fromhex(hex_addr)
    words = [struct.pack("=I", int.from_bytes(raw[i:i + 4], "big")) for i in range(0, len(raw), 4)]
    packed = b"".join(words)
    return socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)


def listening_sockets() -> list[Listener]:
    """Every TCP socket in LISTEN state on this machine (IPv4 and IPv6)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            addr, port = fields[1].rsplit(":", 1)
            out.append(Listener(_decode(addr), int(port, 16), int(fields[9])))
    return out


def socket_inodes(pids) -> set[int]:
    """Inodes of the sockets the given processes hold open (to attribute listeners to a run)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def listeners_of(pids) -> list[Listener]:
    """The listening TCP sockets held by these processes."""
    inodes = socket_inodes(pids)
    return [s for s in listening_sockets() if s.inode in inodes]
