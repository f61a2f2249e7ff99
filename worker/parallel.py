"""Tensor-parallel rank and collectives, passed down to the layers that need them."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(x, src)
        return x

    def shard(self, size: int, what: str) -> int:
        """This rank's part of a dimension of `size`, which must divide evenly."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size {self.world_size}"
            )
        return size // self.world_size

    def split(self, size: int) -> tuple[int, int]:
        """(first, count) of this rank's part of `size` items, as even as it goes:
        the first `size % world_size` ranks hold one more."""
        base, extra = divmod(size, self.world_size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        """(first query head, query heads, first KV head, KV heads) on this rank.

        Heads are split by KV-head groups, so that each rank's query heads read
        only its own KV heads; an uneven count of groups gives some ranks one
        group more (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1). With fewer
        KV heads than ranks, query heads split evenly and each rank replicates
        the one KV head its query heads read.
        """
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.world_size:
            kv_start, kv = self.split(num_kv_heads)
            return kv_start * group, kv * group, kv_start, kv
        if self.world_size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {self.world_size} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        q = self.shard(num_heads, "num_attention_heads")
        return self.rank * q, q, self.rank * num_kv_heads // self.world_size, 1


def init_distributed(
    world_size: int, rank: int, init_addr: str, device: torch.device, timeout: float = 300.0
) -> None:
    """Join the process group: gloo on the CPU, nccl on CUDA, rendezvous at `init_addr`
    (host:port, `[v6]:port` too). A collective (and the rendezvous) that waits `timeout`
    seconds for another rank fails: gloo raises, nccl's watchdog ends the process; either
    way the scheduler hears of it."""
    if world_size <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = split_host_port(init_addr)
    if backend == "gloo" and is_loopback(host):
        _gloo_on_loopback()
    wait = datetime.timedelta(seconds=timeout)
    store = rendezvous_store(host, port, world_size, rank == 0, wait)
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=wait)


def split_host_port(addr: str) -> tuple[str, int]:
    """("::1", 29533) from "[::1]:29533"; ValueError for what is not HOST:PORT."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, not {addr[:80]!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The rendezvous store. Rank 0 serves it on `host` alone: torch's TCPStore would
    listen on every interface whatever the host (its server binds the wildcard address),
    so that anyone who can reach the port could read and write the keys the ranks meet
    by. Here rank 0 binds the socket itself and hands it over (`master_listen_fd`)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    fd = _listen(host, port).detach()  # the store owns (and closes) the fd from here
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.create_server(addr[:2], family=family, backlog=128)
    except OSError as e:  # in use, or not an address of this host
        raise OSError(
            e.errno, f"cannot listen on {host}:{port} (--dist-init-addr): {e.strerror or e}"
        ) from None


def _gloo_on_loopback() -> None:
    """Gloo's own listening sockets follow this host's name (often a LAN address): with a
    loopback rendezvous every rank is on this host, so they go on the loopback interface
    too (GLOO_SOCKET_IFNAME, unless the user set one)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = _loopback_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _loopback_interface() -> str | None:
    """The loopback interface's name (IFF_LOOPBACK in its flags), from /sys/class/net."""
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:
                    return name
        except (OSError, ValueError):
            continue
    return None
