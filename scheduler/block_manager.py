"""The KV block pool: a fixed number of blocks of `block_size` token slots, shared by ref count.

Each sequence has a block table (a list of block ids; position p lives in
block `table[p // block_size]`) that grows as its tokens are planned. Every
block is in exactly one of three states:

- free: holds nothing anyone may ask for (`_free`, FIFO);
- referenced: in the tables of `ref[b] > 0` sequences;
- cached and evictable: `ref[b] == 0`, but it holds a full block of KV that the
  prefix cache can hand out again (`_lru`, least recently freed first).
  Allocation takes free blocks first and evicts from here only when none is left.

Prefix cache. A *full* block whose KV is computed can be keyed: its key is
the hash of `(parent, tokens)`, where `tokens` are the block's `block_size`
token ids and `parent` is the node id of the block before it in the sequence
(0 for the first block): a hash chain over full blocks. The links are exact:
a block keeps its parent and tokens, and a hit must match both, so two
prefixes whose hashes collide never alias (the later one is just not cached);
and a node id is a counter that is never reused. A block keeps its node id
while it is cached; when it is evicted its node dies, and blocks keyed under
it as parent become unreachable (harmless; they go when they are evicted).

Sharing is read-only, so there is no copy-on-write: blocks are append-only, a
block is keyed only once every slot in it is computed, and a sequence that
takes a cached prefix writes from the first position after it, into blocks of
its own. Only full, immutable blocks are ever in two tables; the last, partial
block of a sequence is always private. (A fully cached prompt recomputes its
last block, so that the worker has logits to sample from; the scheduler asks
for at most `(num_tokens - 1) // block_size` blocks.)
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from subway.ipc.prefix import chain_digest

_key_hash = hash  # of (parent node, tokens); a module global so that tests can force collisions

TOKEN_TYPE = "i"  # token ids are int32 arrays (the garbage collector does not walk arrays)
TOKEN_BYTES = array(TOKEN_TYPE).itemsize


def token_bytes(prompt: Sequence[int], output: Sequence[int], a: int, b: int) -> bytes:
    """The raw int32 bytes of tokens `a:b` of `prompt + output` (arrays; lists are converted)."""
    if type(prompt) is not array:
        prompt = array(TOKEN_TYPE, prompt)
    if type(output) is not array:
        output = array(TOKEN_TYPE, output)
    n = len(prompt)
    if b <= n:
        return prompt[a:b].tobytes()
    if a >= n:
        return output[a - n : b - n].tobytes()
    return prompt[a:].tobytes() + output[: b - n].tobytes()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        track_digests: bool = False,
    ) -> None:
        """`track_digests`: keep each cached block's content digest (`ipc/prefix.py`) and
        list those stored and removed (`take_digest_events`), for prefix-aware routing."""
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"bad pool: {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
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

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

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
        total = self.claimed.get(seq_id, 0) + num_new_tokens
        need = -(-total // self.block_size) - (len(table) if table is not None else 0)
        return need if need > 0 else 0

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens) <= self.num_free_blocks

    def max_new_tokens(self, seq_id: int) -> int:
        """How many more tokens the sequence could claim with the blocks free now."""
        table = self._tables.get(seq_id)
        held = (len(table) if table is not None else 0) * self.block_size
        return held - self.claimed.get(seq_id, 0) + self.num_free_blocks * self.block_size

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Claim slots for `num_new_tokens` more tokens; returns the blocks added to the table.

        Raises MemoryError (and changes nothing) if the free blocks do not suffice.
        """
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
        total = self.claimed.get(seq_id, 0) + num_new_tokens
        need = -(-total // self.block_size) - len(table)
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
            if self.track_digests:
                self._count_digest(self._digest[b], -1)
            free.append(b)
        self._num_evictable -= n
        self.num_evictions += n

    def rename(self, seq_id: int, new_id: int) -> None:
        """The sequence's blocks, claims and keying state now belong to `new_id` (a lease
        that outlives the sequence: `scheduler/handoff.py`)."""
        if new_id in self._tables:
            raise AssertionError(f"{new_id} holds blocks already")
        for d in (self._tables, self.claimed, self._keyed, self._last_digest):
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
        if not table:
            return 0
        ref = self._ref
        tokens = self._tokens
        for b in reversed(table):
            n = ref[b]
            if n <= 0:
                raise AssertionError(f"double free of block {b} (sequence {seq_id})")
            ref[b] = n - 1
            if n == 1:
                if tokens[b] is None:
                    self._free.append(b)
                else:
                    self._make_evictable(b)
        return len(table)

    # ------------------------------------------------------------ prefix cache

    def lookup(
        self, prompt: Sequence[int], output: Sequence[int], max_blocks: int, root: int = 0
    ) -> list[int]:
        """The cached blocks that hold the longest prefix of `prompt + output` (token arrays),
        at most `max_blocks` of them, on the chain from `root` (`cache_blocks`). Changes
        nothing."""
        cache = self._cache
        if not cache or max_blocks <= 0:
            return []
        nodes, parents, tokens = self._node, self._parent, self._tokens
        size = self.block_size * TOKEN_BYTES  # bytes of a block's tokens
        data = token_bytes(prompt, output, 0, max_blocks * self.block_size)
        hits: list[int] = []
        node = root
        for a in range(0, len(data), size):
            toks = data[a : a + size]
            b = cache.get(_key_hash((node, toks)))
            if b is None or parents[b] != node or tokens[b] != toks:
                break
            hits.append(b)
            node = nodes[b]
        return hits

    def admission_cost(self, hits: list[int], num_new_tokens: int) -> int:
        """Blocks that `allocate_with_prefix(_, hits, num_new_tokens)` takes out of
        `num_free_blocks`: the new ones, and the hits that nobody holds now."""
        ref = self._ref
        new = -(-num_new_tokens // self.block_size)
        return new + sum(1 for b in hits if ref[b] == 0)

    def allocate_with_prefix(self, seq_id: int, hits: list[int], num_new_tokens: int) -> list[int]:
        """Give a sequence that holds nothing the cached blocks `hits` (from `lookup`), then
        room for `num_new_tokens` tokens after them; returns its whole table (a copy).

        Raises MemoryError (and changes nothing) if the free blocks do not suffice.
        """
        if self._tables.get(seq_id):
            raise AssertionError(f"sequence {seq_id} already holds blocks")
        if self.admission_cost(hits, num_new_tokens) > self.num_free_blocks:
            raise MemoryError(f"sequence {seq_id}: not enough free blocks")
        ref = self._ref
        for b in hits:
            if ref[b] == 0:
                self._stamp[b] = 0  # its entry in the LRU queue is dead
                self._num_evictable -= 1
            ref[b] += 1
        if len(self._lru) > 2 * self._num_evictable + self.sweep_slack:  # mostly dead: sweep
            nb, stamps = self.num_blocks, self._stamp
            self._lru = deque(e for e in self._lru if stamps[e % nb] == e // nb)
        self._tables[seq_id] = list(hits)
        self.claimed[seq_id] = len(hits) * self.block_size
        if hits:
            self._keyed[seq_id] = (len(hits), self._node[hits[-1]])
            if self.track_digests:
                self._last_digest[seq_id] = self._digest[hits[-1]]
        self.allocate(seq_id, num_new_tokens)
        return list(self._tables[seq_id])

    def cache_blocks(
        self, seq_id: int, prompt: Sequence[int], output: Sequence[int], upto: int, root: int = 0
    ) -> int:
        """Key the sequence's full blocks that lie within positions `0 .. upto - 1` (whose KV
        a sent plan computes, and whose tokens are known); returns the position from which
        the next block can be keyed. `root` is the parent of its first block: 0, or minus
        its LoRA adapter's id (an adapter's KV differs from the base model's for the same
        tokens, so each adapter's prefixes are a tree of their own).

        A block whose key is already cached elsewhere (the same prefix computed
        twice) stays private and uncached; the chain goes on from the cached one.
        """
        table = self._tables.get(seq_id)
        bs = self.block_size
        if table is None or not self.enable_caching:
            return upto + bs
        count, node = self._keyed.get(seq_id, (0, root))
        end = min(upto // bs, len(table))
        if count >= end:
            return (count + 1) * bs
        cache, keys, nodes = self._cache, self._key, self._node
        parents, tokens = self._parent, self._tokens
        size = bs * TOKEN_BYTES
        data = token_bytes(prompt, output, count * bs, end * bs)
        track = self.track_digests
        digest = self._last_digest.get(seq_id, root) if track else 0
        for a in range(0, len(data), size):
            toks = data[a : a + size]
            if track:
                digest = chain_digest(digest, toks)
            h = _key_hash((node, toks))
            b = cache.get(h)
            if b is None:
                b = table[count]
                if tokens[b] is not None:
                    raise AssertionError(f"block {b} of sequence {seq_id} is keyed twice")
                cache[h] = b
                keys[b] = h
                tokens[b] = toks
                parents[b] = node
                nodes[b] = node = self._next_node
                self._next_node += 1
                if track:
                    self._digest[b] = digest
                    self._count_digest(digest, 1)
            elif parents[b] == node and tokens[b] == toks:
                node = nodes[b]  # computed twice: the cached copy carries the chain
            else:  # a hash collision: leave this one uncached, on a chain of its own
                node = self._next_node
                self._next_node += 1
            count += 1
        self._keyed[seq_id] = (count, node)
        if track:
            self._last_digest[seq_id] = digest
        return (count + 1) * bs

    def _count_digest(self, digest: int, delta: int) -> None:
        counts = self._digest_count
        n = counts.get(digest, 0) + delta
        if n:
            counts[digest] = n
        else:
            del counts[digest]
        if n == 0 or (n == 1 and delta == 1):
            self._digest_changed ^= {digest}  # twice in one window: no change to report

    def take_digest_events(self) -> tuple[list[int], list[int]]:
        """The digests this engine's prefix cache gained, and lost, since the last call
        (with `track_digests`)."""
        changed, self._digest_changed = self._digest_changed, set()
        counts = self._digest_count
        stored = [d for d in changed if d in counts]
        return stored, [d for d in changed if d not in counts]

    def cached_digests(self) -> list[int]:
        """Every digest the prefix cache holds now (a full report, for a new frontend)."""
        return list(self._digest_count)
