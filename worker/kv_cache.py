"""How many KV blocks a worker can hold, and their allocation."""

from __future__ import annotations

import torch

from subway.kernels.attention import KV_SCALE_BYTES
from subway.worker.huge_pages import fresh_zeros
from subway.worker.model import KVCache


def kv_slot_layout(head_dim: int, dtype: torch.dtype, kv_int8: bool) -> tuple[int, torch.dtype]:
    """The last dimension and element type of a cache: one head vector of one slot.

    With `kv_int8` (`--kv-cache-dtype int8`), `head_dim` int8 values and then their float32
    scale (`kernels.attention.quantize_kv`); else `head_dim` values of the model's `dtype`.
    """
    return (head_dim + KV_SCALE_BYTES, torch.int8) if kv_int8 else (head_dim, dtype)


def block_bytes(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_int8: bool = False,
) -> int:
    """Bytes of one block across all layers, keys and values."""
    width, elem = kv_slot_layout(head_dim, dtype, kv_int8)
    return 2 * num_layers * block_size * num_kv_heads * width * elem.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    huge_pages: bool = True,
    kv_int8: bool = False,
) -> list[KVCache]:
    """One `(k_cache, v_cache)` pair per layer, each `[num_blocks, block_size, kv_heads, head_dim]`
    of `dtype`, or with `kv_int8` int8 `[..., head_dim + 4]` (`kv_slot_layout`).

    Zero-filled: a padded (masked) key must never be NaN, or 0 * NaN leaks into softmax @ V.
    On the CPU, fresh zero pages (`fresh_zeros`) committed as blocks are first written, not
    at start (a 1 GiB pool took about 2 s of a worker's start to write), in transparent huge
    pages where the kernel allows them: decode attention reads blocks scattered over the
    pool, a TLB miss per 4 KiB page otherwise.
    """
    width, dtype = kv_slot_layout(head_dim, dtype, kv_int8)
    shape = (num_blocks, block_size, num_kv_heads, width)

    def one() -> torch.Tensor:
        if device.type == "cpu":
            return fresh_zeros(shape, dtype, huge=huge_pages)
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
