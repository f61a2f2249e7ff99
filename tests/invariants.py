"""The scheduler's and the block manager's invariants, checked by the tests after every step."""

from __future__ import annotations

from subway.scheduler import prefix_cache
from subway.scheduler.block_manager import TOKEN_BYTES, BlockManager
from subway.scheduler.request import RequestStatus
from subway.scheduler.scheduler import Scheduler

MAX_DRAFT = 16  # num_speculative_tokens at most


def check_block_manager(bm: BlockManager) -> None:
    """Counts, states, the cache, sharing."""
    counts = [0] * bm.num_blocks
    G = bm.num_groups
    for table in bm._tables.values():
        held = [b for b in table if b >= 0]
        if len(set(held)) != len(held) or len(table) % G:
            raise AssertionError(f"a block twice in one table, or a table not of groups: {table}")
        for b in held:
            counts[b] += 1
    free = set(bm._free)
    if len(free) != len(bm._free):
        raise AssertionError("a block is on the free list twice")
    evictable = {b for b in range(bm.num_blocks) if bm._stamp[b]}
    live = [e for e in bm._lru if bm._stamp[e % bm.num_blocks] == e // bm.num_blocks]
    if sorted(e % bm.num_blocks for e in live) != sorted(evictable):
        raise AssertionError("the LRU queue and the evictable blocks disagree")
    if len(evictable) != bm._num_evictable:
        raise AssertionError("the evictable count is off")
    if free & evictable:
        raise AssertionError(f"blocks both free and evictable: {free & evictable}")
    for b in range(bm.num_blocks):
        if counts[b] != bm._ref[b]:
            raise AssertionError(f"block {b}: ref {bm._ref[b]}, in {counts[b]} tables")
        idle = b in free or b in evictable
        if idle == (counts[b] > 0):
            raise AssertionError(f"block {b}: idle={idle}, refs={counts[b]}")
        if b in evictable and bm._tokens[b] is None:
            raise AssertionError(f"evictable block {b} is not cached")
        if b in free and bm._tokens[b] is not None:
            raise AssertionError(f"free block {b} is still cached")
        if counts[b] > 1 and bm._tokens[b] is None:
            raise AssertionError(f"block {b} is shared by {counts[b]} tables but not cached")
        if bm._tokens[b] is not None and bm._cache.get(bm._key[b]) != b:
            raise AssertionError(f"block {b} is cached but the cache does not point to it")
    for h, b in bm._cache.items():
        if bm._key[b] != h:
            raise AssertionError(f"cache entry for block {b} has a stale key")
        toks = bm._tokens[b]
        marks = {prefix_cache.companion_mark(k): k for k in range(1, G)}
        if toks in marks:  # a page of group k > 0, keyed under its group-0 page's node
            if prefix_cache._key_hash(("g", marks[toks], bm._parent[b])) != h:
                raise AssertionError(f"page {b} is cached under a key that is not its own")
            continue
        if toks is None or len(toks) != bm.block_size * TOKEN_BYTES:
            raise AssertionError(f"block {b} is cached but not full")
        if prefix_cache._key_hash((bm._parent[b], toks)) != h:  # (tests patch it)
            raise AssertionError(f"block {b} is cached under a key that is not its own")
    if len(bm._cache) != sum(t is not None for t in bm._tokens):
        raise AssertionError("the cache and the cached blocks disagree")
    for seq_id, table in bm._tables.items():
        n = bm.claimed.get(seq_id, 0)
        need = -(-n // bm.block_size)
        # Beyond what it claims, a table keeps the blocks of a rejected draft (at most 16).
        if not need <= len(table) // G <= -(-(n + MAX_DRAFT) // bm.block_size):
            raise AssertionError(f"sequence {seq_id}: {len(table)} blocks for {n} tokens")
        count, _ = bm._keyed.get(seq_id, (0, 0))
        for b in table[count * G :]:
            if b >= 0 and counts[b] > 1:
                raise AssertionError(f"sequence {seq_id} shares block {b} beyond its prefix")
        for k, w in enumerate(bm.windows):  # a group's pages: held from its first read on
            first = max(0, n - w + 1) // bm.block_size if w else 0
            if any(table[j * G + k] < 0 for j in range(first, len(table) // G)):
                raise AssertionError(f"sequence {seq_id}: group {k} lacks a block it reads")


def check_scheduler(sched: Scheduler) -> None:
    """The scheduler's own invariants, and the block manager's."""
    bm = sched.block_manager
    check_block_manager(bm)
    running = [r for r in sched.running if r.status is RequestStatus.RUNNING]
    if len(running) != sched.num_running or len({id(r) for r in running}) != len(running):
        raise AssertionError("the running list and count disagree")
    if sched.num_running > sched.max_num_seqs:
        raise AssertionError(f"{sched.num_running} running, cap {sched.max_num_seqs}")
    if any(r.status is not RequestStatus.WAITING for r in sched.waiting):
        raise AssertionError("a request in the waiting queue is not waiting")
    key = sched.policy.key
    if any(key(a) > key(b) for a, b in zip(sched.waiting, sched.waiting[1:], strict=False)):
        raise AssertionError("the waiting queue is out of order")
    if sum(r.preempted for r in sched.waiting) != sched.stats.num_preempted_waiting:
        raise AssertionError("num_preempted_waiting is off")
    for r in running:
        sid = r.seq_id
        if bm.num_claimed(sid) != r.num_computed_tokens:
            raise AssertionError(f"seq {sid}: claims {bm.num_claimed(sid)} slots, "
                                 f"computed {r.num_computed_tokens}")  # fmt: skip
        if r.num_slots != bm.slots(bm.block_table(sid)):
            raise AssertionError(f"seq {sid}: num_slots {r.num_slots} is off")
    for r in sched.waiting:
        if bm.block_table(r.seq_id):
            raise AssertionError(f"waiting seq {r.seq_id} holds blocks")
