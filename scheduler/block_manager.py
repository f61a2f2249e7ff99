"""The KV block pool: a fixed number of blocks of `block_size` token slots, shared by ref count.

Each sequence has a block table (a list of block ids; position p lives in
block `table[p // block_size]`) that grows as its tokens are planned. Every
block is in exactly one of three states:

- free: holds nothing anyone may ask for (`_free`, FIFO);
- referenced: in the tables of `ref[b] > 0` sequences;
- cached and evictable: `ref[b] == 0`, but it holds a full block of KV that the
  prefix cache can hand out again (`_lru`, least recently freed first).
  Allocation takes free blocks first and evicts from here only when none is left.

Prefix cache: `prefix_cache.py` (keys, lookups, admission with a cached prefix).

Sliding windows (`windows`, one per KV group: `ipc/kv_groups.py`). With several groups a
logical block is a page in each group, the table is flat (`table[j * num_groups + k]`)
and every count here is in pages. A sliding group's pages wholly behind its window
from the sequence's next position on are released (`_slide`: -1 in the table, the page
free or evictable), before anything is asked of the sequence's room; its global
groups keep theirs. A decode's next position only grows (a rejected draft rolls back
no further than the step's first), so a released page is never read again; a plan in
flight that still reads one runs before any later plan can write it.
"""

from __future__ import annotations

from array import array
from collections import deque

from subway.scheduler.prefix_cache import PrefixCache
from subway.scheduler.tokens import TOKEN_BYTES, TOKEN_TYPE, token_bytes

__all__ = ["TOKEN_BYTES", "TOKEN_TYPE", "BlockManager", "token_bytes"]


class BlockManager(PrefixCache):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        track_digests: bool = False,
        windows: tuple[int, ...] = (0,),
    ) -> None:
        """`track_digests`: keep each cached block's content digest (`ipc/prefix.py`) and
        list those stored and removed (`take_digest_events`), for prefix-aware routing.
        `windows`: each KV group's window (0: global; `ipc/kv_groups.py`)."""
        if num_blocks < 0 or block_size <= 0 or not windows or min(windows) < 0:
            raise ValueError(f"bad pool: {num_blocks} blocks of {block_size}, groups {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        self._sliding = [(k, w) for k, w in enumerate(windows) if w]
        self._slid: dict[int, list[int]] = {}  # per sequence: per sliding group, blocks released
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: the oldest freed goes first
        # The evictable blocks, least recently freed first: a queue of `stamp * num_blocks + b`
        # entries, where an entry is live while `_stamp[b]` is its stamp (0: not evictable).
        # A hit takes a block out by zeroing its stamp; dead entries are skipped when met and
        # swept when they outnumber live ones. (An OrderedDict would be simpler, but the
        # garbage collector walks its nodes on every full collection: milliseconds at 100k.)
        self._lru: deque[int] = deque()
        self._stamp = array("q", [0]) * num_blocks
        self._next_stamp = 1
        self._num_evictable = 0
        self.sweep_slack = 1024  # dead LRU entries tolerated beyond the live ones (x2)
        # Per-block state in arrays: the garbage collector does not walk them.
        self._ref = array("i", [0]) * num_blocks
        self._tables: dict[int, list[int]] = {}
        # Token slots each sequence has claimed. Public for one fast path: the scheduler bumps
        # it in place for a decode whose last block still has room (no allocation needed).
        self.claimed: dict[int, int] = {}
        # Prefix cache.
        self._cache: dict[int, int] = {}  # key hash -> the block cached under it
        # A block is cached iff it has tokens; then it has a key hash, a parent and a node.
        self._tokens: list[bytes | None] = [None] * num_blocks  # raw token ids, to check hits
        self._key = array("q", [0]) * num_blocks
        self._parent = array("q", [0]) * num_blocks
        self._node = array("q", [0]) * num_blocks
        self._next_node = 1  # 0 is the empty prefix
        # Per sequence: (blocks of its table already keyed or found keyed, node of the last).
        self._keyed: dict[int, tuple[int, int]] = {}
        self.num_evictions = 0
        self.track_digests = track_digests
        self._digest = array("q", [0]) * num_blocks  # of each cached block, when tracked
        self._last_digest: dict[int, int] = {}  # per sequence: the digest of its last keyed block
        # How many cached blocks carry each digest (two can, when a prefix was computed again
        # after its parent's eviction), and the digests whose presence changed since the
        # last take: an engine reports a digest while at least one block carries it.
        self._digest_count: dict[int, int] = {}
        self._digest_changed: set[int] = set()

    # ------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + self._num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live sequences (cached blocks nobody holds do not count)."""
        return self.num_blocks - len(self._free) - self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks nobody holds: evictable, counted in `num_free_blocks`."""
        return self._num_evictable

    def capacity_tokens(self, max_chunk: int) -> int:
        """The longest sequence that fits in the pool alone, prefilled in chunks of at most
        `max_chunk` tokens: every group holds its blocks, a sliding one at most those its
        window and a chunk reach."""
        bs, G = self.block_size, self.num_groups
        if not self._sliding:
            return self.num_blocks // G * bs
        window_pages = sum(-(-(w + max_chunk) // bs) + 1 for _, w in self._sliding)
        num_global = G - len(self._sliding)
        if window_pages > self.num_blocks:
            return self.num_blocks // G * bs
        if num_global == 0:
            return 1 << 40  # sliding groups only: any length
        return max((self.num_blocks - window_pages) // num_global * bs, self.num_blocks // G * bs)

    def slots(self, blocks: list[int]) -> int:
        """Token slots that `blocks` (pages, as `allocate` returns them) add to a table."""
        return len(blocks) // self.num_groups * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (empty if it holds none). Do not mutate it."""
        return self._tables.get(seq_id, [])

    def num_claimed(self, seq_id: int) -> int:
        """Token slots claimed by `seq_id` (positions computed or planned)."""
        return self.claimed.get(seq_id, 0)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._tokens[block] is not None

    # ------------------------------------------------------------ growth

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_new_tokens` more tokens."""
        table = self._tables.get(seq_id)
        if self._sliding and table:
            self._slide(seq_id, table)
        G = self.num_groups
        total = self.claimed.get(seq_id, 0) + num_new_tokens
        need = -(-total // self.block_size) - (len(table) // G if table is not None else 0)
        return need * G if need > 0 else 0

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens) <= self.num_free_blocks

    def max_new_tokens(self, seq_id: int) -> int:
        """How many more tokens the sequence could claim with the blocks free now."""
        table = self._tables.get(seq_id)
        if self._sliding and table:
            self._slide(seq_id, table)
        G, bs = self.num_groups, self.block_size
        held = (len(table) // G if table is not None else 0) * bs
        return held - self.claimed.get(seq_id, 0) + self.num_free_blocks // G * bs

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Claim slots for `num_new_tokens` more tokens; returns the blocks added to the table.

        Raises MemoryError (and changes nothing) if the free blocks do not suffice.
        """
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
        elif self._sliding:
            self._slide(seq_id, table)
        total = self.claimed.get(seq_id, 0) + num_new_tokens
        need = (-(-total // self.block_size) - len(table) // self.num_groups) * self.num_groups
        if need <= 0:
            self.claimed[seq_id] = total
            return []
        free = self._free
        if need > len(free):
            if need > len(free) + self._num_evictable:
                if not table:
                    del self._tables[seq_id]
                raise MemoryError(
                    f"sequence {seq_id} needs {need} blocks, {self.num_free_blocks} are free"
                )
            self._evict(need - len(free))
        ref = self._ref
        new = [free.popleft() for _ in range(need)]
        for b in new:
            if ref[b] != 0:
                raise AssertionError(f"block {b} on the free list has {ref[b]} references")
            ref[b] = 1
        table.extend(new)
        self.claimed[seq_id] = total
        return new

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Give back claimed slots beyond the first `num_tokens` (a speculative step's
        rejected draft). The blocks stay in the table, for the sequence to grow into."""
        claimed = self.claimed.get(seq_id)
        if claimed is None or num_tokens > claimed:
            raise AssertionError(f"sequence {seq_id}: trim to {num_tokens} of {claimed} slots")
        self.claimed[seq_id] = num_tokens

    def _slide(self, seq_id: int, table: list[int]) -> None:
        """Release each sliding group's pages that no query from the sequence's next
        position on reads: block j, once (j + 1) * block_size <= pos - window + 1."""
        slid = self._slid.get(seq_id)
        if slid is None:
            slid = self._slid[seq_id] = [0] * len(self._sliding)
        pos, bs, G = self.claimed.get(seq_id, 0), self.block_size, self.num_groups
        held = len(table) // G
        for i, (k, w) in enumerate(self._sliding):
            dead = min(max(0, pos - w + 1) // bs, held)
            for j in range(slid[i], dead):
                b = table[j * G + k]
                if b >= 0:
                    table[j * G + k] = -1
                    self._unref(b, seq_id)
            if dead > slid[i]:
                slid[i] = dead

    def _unref(self, b: int, seq_id: int) -> None:
        """Drop a table's reference to `b`: nobody else's, it becomes free, or evictable
        if it is cached."""
        n = self._ref[b]
        if n <= 0:
            raise AssertionError(f"double free of block {b} (sequence {seq_id})")
        self._ref[b] = n - 1
        if n == 1:
            if self._tokens[b] is None:
                self._free.append(b)
            else:
                self._make_evictable(b)

    def _make_evictable(self, b: int) -> None:
        stamp = self._next_stamp
        self._next_stamp = stamp + 1
        self._stamp[b] = stamp
        self._lru.append(stamp * self.num_blocks + b)
        self._num_evictable += 1

    def _evict(self, n: int) -> None:
        """Move the `n` least recently freed cached blocks to the free list, forgetting them."""
        lru, stamps, nb = self._lru, self._stamp, self.num_blocks
        cache, keys, tokens, free = self._cache, self._key, self._tokens, self._free
        for _ in range(n):
            while True:
                stamp, b = divmod(lru.popleft(), nb)
                if stamps[b] == stamp:
                    break
            stamps[b] = 0
            del cache[keys[b]]
            tokens[b] = None
            if self.track_digests and self._node[b]:  # (group 0's pages carry digests)
                self._count_digest(self._digest[b], -1)
            free.append(b)
        self._num_evictable -= n
        self.num_evictions += n

    def rename(self, seq_id: int, new_id: int) -> None:
        """The sequence's blocks, claims and keying state now belong to `new_id` (a lease
        that outlives the sequence: `scheduler/handoff.py`)."""
        if new_id in self._tables:
            raise AssertionError(f"{new_id} holds blocks already")
        for d in (self._tables, self.claimed, self._keyed, self._last_digest, self._slid):
            if seq_id in d:
                d[new_id] = d.pop(seq_id)

    def free(self, seq_id: int) -> int:
        """Return the sequence's blocks to the pool; returns how many references were dropped.

        A block nobody else holds becomes free, or evictable if it is cached
        (the table is walked backwards, so a prefix's tail is evicted before
        its head). Freeing a sequence that holds nothing is a no-op; a block
        whose count is already 0 raises (a double free).
        """
        table = self._tables.pop(seq_id, None)
        self.claimed.pop(seq_id, None)
        self._keyed.pop(seq_id, None)
        self._last_digest.pop(seq_id, None)
        self._slid.pop(seq_id, None)
        if not table:
            return 0
        dropped = 0
        for b in reversed(table):
            if b >= 0:
                self._unref(b, seq_id)
                dropped += 1
        return dropped
