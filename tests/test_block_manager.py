"""The KV block pool: growth, freeing, counts, no leak and no double free."""

from __future__ import annotations

import random

import pytest

from subway.scheduler.block_manager import BlockManager


def test_allocate_as_you_grow():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert bm.blocks_needed(1, 5) == 2
    new = bm.allocate(1, 5)
    assert len(new) == 2 and bm.block_table(1) == new
    assert bm.num_tokens(1) == 5
    assert bm.allocate(1, 3) == []  # fills the second block
    assert bm.blocks_needed(1, 1) == 1
    assert len(bm.allocate(1, 1)) == 1
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    assert bm.max_new_tokens(1) == 3 + 5 * 4
    bm.check()
    assert bm.free(1) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert bm.block_table(1) == []
    bm.check()


def test_exhaustion_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(1, 4)
    assert not bm.can_allocate(2, 3)
    assert bm.can_allocate(2, 2)
    with pytest.raises(MemoryError):
        bm.allocate(2, 3)
    assert bm.block_table(2) == [] and bm.num_free_blocks == 1
    with pytest.raises(MemoryError):
        bm.allocate(1, 3)
    assert bm.num_tokens(1) == 4 and len(bm.block_table(1)) == 2
    bm.check()


def test_free_is_idempotent_per_sequence_and_double_free_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    assert bm.free(1) == 1
    assert bm.free(1) == 0  # nothing held: no-op
    assert bm.free(99) == 0
    bm.allocate(2, 4)
    bm._tables[3] = list(bm.block_table(2))  # forge a second owner without a reference
    bm.free(2)
    with pytest.raises(AssertionError):
        bm.free(3)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: set[int] = set()
    for i in range(3000):
        sid = rng.randrange(20)
        if rng.random() < 0.3 and sid in live:
            bm.free(sid)
            live.discard(sid)
        else:
            n = rng.randrange(1, 9)
            if bm.can_allocate(sid, n):
                bm.allocate(sid, n)
                live.add(sid)
            else:
                with pytest.raises(MemoryError):
                    bm.allocate(sid, n)
        if i % 100 == 0:
            bm.check()
    for sid in live:
        bm.free(sid)
    bm.check()
    assert bm.num_free_blocks == 32


def test_bad_pool():
    with pytest.raises(ValueError):
        BlockManager(4, 0)
