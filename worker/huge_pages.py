"""Transparent huge pages for what a CPU worker reads whole every step: weights, KV cache.

With 4 KiB pages every page a step reads costs a TLB miss; a decode step reads all the
weights, and decode attention reads KV blocks scattered over the pool. The served
worker gets huge pages for every large allocation from glibc's malloc
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, set by the launcher); in any process the KV
cache is mapped fresh and advised (`fresh_zeros`), and the plain weights of the one-row
linear are copied into one such arena (`rehome`), which the offline `LLM` needs.
Measured in docs/bench/log/2026-12-vs-vllm-avx512-amx.md ("Round 2: attention's
softmax, huge pages"). Where the kernel's setting is "never",
all of this is a no-op.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE = 2 << 20  # a transparent huge page


def fresh_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zero-filled CPU tensor in memory of its own, mapped fresh (anonymous memory is zero),
    starting on a huge page and, with `huge`, advised for huge pages (Linux). Fresh: memory
    from malloc may come from pages already touched in small pages, which the advice does
    not change (glibc serves ever larger blocks from its heap once large blocks have been
    freed). Nothing is written: each page is committed (zeroed by the kernel) when first
    touched, so a cache of gigabytes costs nothing to make (`torch.zeros` writes it all: on
    these VMs about 2 s a GiB, most of a default-model worker's start). The mapping lives as
    long as the tensor (torch keeps the buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    size = -(-max(nbytes, 1) // HUGE) * HUGE + HUGE  # room to start on a huge page
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and sys.platform.startswith("linux"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages, still correct
            pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE
    return raw[off : off + nbytes].view(dtype).view(shape)


def rehome(params: list[torch.Tensor]) -> torch.Tensor | None:
    """Move same-dtype CPU tensors (parameters or not) into one arena in huge pages (each
    64-byte aligned); the arena, or None when there is nothing to move. Values are unchanged."""
    if not params:
        return None
    dtype = params[0].dtype
    if any(p.dtype != dtype or p.device.type != "cpu" for p in params):
        raise ValueError("rehome: CPU parameters of one dtype only")
    align = max(1, 64 // dtype.itemsize)
    sizes = [-(-p.numel() // align) * align for p in params]
    arena = fresh_zeros((sum(sizes),), dtype)
    off = 0
    for p, n in zip(params, sizes, strict=True):
        view = arena[off : off + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        off += n
    return arena
