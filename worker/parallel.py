"""Tensor-parallel rank and collectives, passed down to the layers that need them."""

from __future__ import annotations

import datetime
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
    """Join the process group: gloo on the CPU, nccl on CUDA, rendezvous at tcp://init_addr.
    A collective (and the rendezvous) that waits `timeout` seconds for another rank fails:
    gloo raises, nccl's watchdog ends the process; either way the scheduler hears of it."""
    if world_size <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout),
    )
