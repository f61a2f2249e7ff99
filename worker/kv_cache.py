"""How many KV blocks a worker can hold, and their allocation."""

from __future__ import annotations

import torch

from subway.worker.huge_pages import huge_empty
from subway.worker.model import KVCache


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    huge_pages: bool = True,
) -> list[KVCache]:
    """One `(k_cache, v_cache)` pair per layer, each `[num_blocks, block_size, kv_heads, head_dim]`.

    Zero-filled: a padded (masked) key must never be NaN, or 0 * NaN leaks into softmax @ V.
    On the CPU, in transparent huge pages where the kernel allows them (`huge_empty`):
    decode attention reads blocks scattered over the pool, a TLB miss per 4 KiB page
    otherwise.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def one() -> torch.Tensor:
        if device.type == "cpu" and huge_pages:
            # Written once now, as torch.zeros would: the pages are committed here, not by
            # page faults (2 MiB zeroed each) in the first steps that write there.
            return huge_empty(shape, dtype).zero_()
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(one(), one()) for _ in range(num_layers)]


def cuda_kv_budget(utilization: float, device: torch.device, peak_bytes: int) -> int:
    """Bytes left for the KV cache on a CUDA device after the weights and a profiled step.

    `peak_bytes` is the peak of torch allocations during the profile run (weights
    included); memory held outside torch (other processes, the CUDA context) is
    the device's used memory minus what torch reserved.
    """
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    return int(total * utilization) - peak_bytes - max(non_torch, 0)
