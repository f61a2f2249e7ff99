"""Huge pages for the CPU worker: the weights' arena, the KV cache's advice, the launcher's tunable."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from subway.ipc.config import EngineConfig
from subway.tools.launch import with_huge_pages
from subway.worker.huge_pages import HUGE, rehome
from subway.worker.kv_cache import allocate_kv_cache


def test_rehome_keeps_values_in_one_aligned_arena():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 40).to(torch.bfloat16)) for n in (7, 300, 1)]
    before = [p.detach().clone() for p in params]
    arena = rehome(params)
    assert arena is not None
    base = arena.untyped_storage().data_ptr()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)
        assert p.untyped_storage().data_ptr() == base  # all views of the arena
        assert p.data_ptr() % 64 == 0
    assert params[0].data_ptr() % HUGE == 0  # the arena starts on a huge page
    with pytest.raises(ValueError):
        rehome([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).double())])
    assert rehome([]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_kv_cache_is_zeroed_and_advised_and_committed_only_where_written():
    rss = psutil.Process().memory_info().rss
    caches = allocate_kv_cache(2, 4096, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    nbytes = sum(t.nbytes for kv in caches for t in kv)  # 64 MiB
    assert psutil.Process().memory_info().rss - rss < nbytes // 8  # nothing written at start
    assert all(not k.any() and not v.any() for k, v in caches)
    assert all(t.data_ptr() % HUGE == 0 for kv in caches for t in kv)
    for k, v in caches:  # pages are committed on the first write (a read maps the zero page)
        k.fill_(1)
        v.fill_(1)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" not in thp:
        with open("/proc/self/smaps_rollup") as f:
            huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
        assert huge * 1024 >= 2 * HUGE  # 16 MiB of cache: several huge pages at least


def test_the_launcher_asks_glibc_for_huge_pages_unless_told_otherwise():
    assert with_huge_pages("") == "glibc.malloc.hugetlb=1"
    assert with_huge_pages("glibc.malloc.arena_max=2") == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    assert with_huge_pages("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"
    assert EngineConfig.build(huge_pages=False).model.huge_pages is False
