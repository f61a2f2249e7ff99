"""The KV block pool: growth, freeing, counts, no leak and no double free."""

from __future__ import annotations

import random

import pytest
from invariants import check_block_manager

from subway.scheduler.block_manager import BlockManager


def test_allocate_as_you_grow():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert bm.blocks_needed(1, 5) == 2
    new = bm.allocate(1, 5)
    assert len(new) == 2 and bm.block_table(1) == new
    assert bm.num_claimed(1) == 5
    assert bm.allocate(1, 3) == []  # fills the second block
    assert bm.blocks_needed(1, 1) == 1
    assert len(bm.allocate(1, 1)) == 1
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    assert bm.max_new_tokens(1) == 3 + 5 * 4
    check_block_manager(bm)
    assert bm.free(1) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert bm.block_table(1) == []
    check_block_manager(bm)


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
    assert bm.num_claimed(1) == 4 and len(bm.block_table(1)) == 2
    check_block_manager(bm)


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
            check_block_manager(bm)
    for sid in live:
        bm.free(sid)
    check_block_manager(bm)
    assert bm.num_free_blocks == 32


def test_bad_pool():
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ---------------------------------------------------------------- prefix cache


def test_full_blocks_are_cached_and_shared_read_only():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: blocks [1-4] [5-8] and a partial one
    bm.allocate(1, 10)
    assert bm.cache_blocks(1, prompt, [], 10) == 12  # two full blocks keyed; next at 12
    t1 = bm.block_table(1)
    assert [bm.is_cached(b) for b in t1] == [True, True, False]
    # Another sequence with the same first 9 tokens: both full blocks hit.
    other = prompt[:9] + [99]
    hits = bm.lookup(other, [], (len(other) - 1) // 4)
    assert hits == t1[:2]
    table = bm.allocate_with_prefix(2, hits, len(other) - 8)
    assert table[:2] == t1[:2] and table[2] != t1[2]  # the partial block is private
    assert [bm.ref_count(b) for b in t1] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    check_block_manager(bm)


def test_lookup_stops_at_first_miss_and_respects_the_cap():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    toks = [1, 2, 3, 4, 5, 6]
    bm.allocate(1, 6)
    bm.cache_blocks(1, toks, [], 6)
    assert len(bm.lookup(toks, [], 3)) == 3
    assert len(bm.lookup(toks, [], (len(toks) - 1) // 2)) == 2  # the last token is recomputed
    assert len(bm.lookup([1, 2, 9, 4, 5, 6], [], 3)) == 1  # the chain breaks at block 1
    assert bm.lookup([3, 4, 5, 6], [], 2) == []  # same block content, other parent: no hit
    assert len(bm.lookup([1, 2], [3, 4, 7], 2)) == 2  # prompt + output are one token stream


def test_cached_blocks_outlive_their_sequence_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    bm.allocate(1, 4)
    bm.cache_blocks(1, a, [], 4)
    bm.free(1)
    bm.allocate(2, 4)
    bm.cache_blocks(2, b, [], 4)
    bm.free(2)
    assert (bm.num_used_blocks, bm.num_cached_blocks, bm.num_free_blocks) == (0, 4, 4)
    check_block_manager(bm)
    # Taking 2 blocks evicts the least recently freed: sequence 1's (its tail first).
    bm.allocate(3, 4)
    assert bm.num_evictions == 2
    assert bm.lookup(a, [], 2) == [] and len(bm.lookup(b, [], 2)) == 2
    check_block_manager(bm)
    # A hit on an evictable block takes it back out of the LRU.
    hits = bm.lookup(b, [], 1)
    assert bm.admission_cost(hits, 1) == 2
    bm.allocate_with_prefix(4, hits, 1)  # its new block evicts the other one
    assert bm.ref_count(hits[0]) == 1 and bm.num_evictions == 3
    assert (bm.num_used_blocks, bm.num_cached_blocks, bm.num_free_blocks) == (4, 0, 0)
    with pytest.raises(MemoryError):
        bm.allocate(5, 1)
    check_block_manager(bm)


def test_tail_block_is_evicted_before_the_head():
    bm = BlockManager(num_blocks=3, block_size=2, enable_caching=True)
    toks = [1, 2, 3, 4, 5, 6]
    bm.allocate(1, 6)
    bm.cache_blocks(1, toks, [], 6)
    bm.free(1)
    bm.allocate(2, 2)  # one eviction: the last block of the prefix goes
    assert len(bm.lookup(toks, [], 3)) == 2


def test_same_prefix_computed_twice_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    toks = [1, 2, 3, 4, 5]
    bm.allocate(1, 5)
    bm.allocate(2, 5)  # both computed it before either was keyed
    bm.cache_blocks(1, toks, [], 5)
    bm.cache_blocks(2, toks + [6], [], 6)  # its third block is new: chained from 1's blocks
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert [bm.is_cached(b) for b in t2] == [False, False, True]
    assert bm.lookup(toks + [6, 7], [], 3) == t1[:2] + t2[2:]
    bm.free(1)
    bm.free(2)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 8
    check_block_manager(bm)


def test_no_caching_when_disabled():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(1, 4)
    bm.cache_blocks(1, [1, 2, 3, 4], [], 4)
    bm.free(1)
    assert bm.num_cached_blocks == 0 and bm.lookup([1, 2, 3, 4], [], 2) == []


def test_admission_cost_counts_evictable_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    bm.allocate(1, 4)
    bm.cache_blocks(1, [1, 2, 3, 4], [], 4)
    hits = bm.lookup([1, 2, 3, 4, 5], [], 2)
    assert bm.admission_cost(hits, 1) == 1  # held by 1: sharing is free
    bm.free(1)
    assert bm.admission_cost(hits, 1) == 3  # evictable hits leave the free pool too
    with pytest.raises(AssertionError):
        bm.allocate(2, 1)
        bm.allocate_with_prefix(2, hits, 1)  # it already holds blocks
    bm.free(2)
    table = bm.allocate_with_prefix(3, hits, 1)
    assert table[:2] == hits and bm.num_free_blocks == 1
    check_block_manager(bm)


@pytest.mark.parametrize("sweep_slack", [1024, 0])
def test_random_workload_with_sharing_never_leaks(sweep_slack):
    rng = random.Random(1)
    bs = 4
    bm = BlockManager(num_blocks=24, block_size=bs, enable_caching=True)
    bm.sweep_slack = sweep_slack  # 0: the LRU queue is swept of dead entries all the time
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    live: dict[int, list[int]] = {}
    for i in range(4000):
        sid = rng.randrange(16)
        if sid in live and rng.random() < 0.3:
            bm.cache_blocks(sid, live[sid], [], bm.num_claimed(sid))
            bm.free(sid)
            del live[sid]
        elif sid in live:
            toks = live[sid]
            n = rng.randrange(1, 6)
            if bm.can_allocate(sid, n):
                done = bm.num_claimed(sid)
                bm.allocate(sid, n)
                toks += [rng.randrange(5) for _ in range(n)]
                bm.cache_blocks(sid, toks, [], done)  # only what earlier "steps" computed
        else:
            toks = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(5)]
            hits = bm.lookup(toks, [], (len(toks) - 1) // bs)
            n = len(toks) - len(hits) * bs
            if bm.admission_cost(hits, n) <= bm.num_free_blocks:
                bm.allocate_with_prefix(sid, hits, n)
                live[sid] = toks
        if i % 50 == 0:
            check_block_manager(bm)
    for sid in list(live):
        bm.free(sid)
    check_block_manager(bm)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 24
    assert bm.num_evictions > 100 and bm.num_cached_blocks > 0


def test_hash_collisions_never_alias(monkeypatch):
    from subway.scheduler import prefix_cache

    monkeypatch.setattr(prefix_cache, "_key_hash", lambda key: 42)  # every key collides
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    bm.allocate(1, 4)
    bm.cache_blocks(1, [1, 2, 3, 4], [], 4)  # block 0 is cached; block 1 collides with it
    assert [bm.is_cached(b) for b in bm.block_table(1)] == [True, False]
    assert len(bm.lookup([1, 2, 3, 4, 5], [], 2)) == 1
    assert bm.lookup([9, 9, 3, 4], [], 2) == []  # same hash, other tokens: a miss
    check_block_manager(bm)
