"""Transparent huge pages for what a CPU worker reads whole every step: weights, KV cache.

With 4 KiB pages every page a step reads costs a TLB miss; a decode step reads all the
weights, and decode attention reads KV blocks scattered over the pool. The served
worker gets huge pages for every large allocation from glibc's malloc
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, set by the launcher); in any process the KV
cache is advised before its first touch, and the plain weights of the one-row linear
are copied into one advised arena (`rehome`), which the offline `LLM` needs.
Measured in docs/BENCHMARKS.md ("Huge pages"). Where the kernel's setting is "never",
all of this is a no-op.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE = 2 << 20  # a transparent huge page
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside a CPU tensor's memory (Linux;
    pages already touched stay small until the kernel collapses them)."""
    if not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE) * HUGE
    hi = end // HUGE * HUGE
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0


def rehome(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Move same-dtype CPU parameters into one arena in huge pages (each 64-byte aligned);
    the arena, or None when there is nothing to move. Values are unchanged."""
    if not params:
        return None
    dtype = params[0].dtype
    if any(p.dtype != dtype or p.device.type != "cpu" for p in params):
        raise ValueError("rehome: CPU parameters of one dtype only")
    align = max(1, 64 // params[0].element_size())
    sizes = [-(-p.numel() // align) * align for p in params]
    arena = torch.empty(sum(sizes) + HUGE // params[0].element_size(), dtype=dtype)
    advise_huge_pages(arena)
    off = (-arena.data_ptr() % HUGE) // arena.element_size()  # start on a huge page
    for p, n in zip(params, sizes, strict=True):
        view = arena[off : off + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        off += n
    return arena
