"""The prefix cache of the block pool: lookups, keying, admission with a cached prefix.

A *full* block whose KV is computed can be keyed: its key is the hash of
`(parent, tokens)`, where `tokens` are the block's `block_size` token ids and `parent`
is the node id of the block before it in the sequence (0 for the first block, or minus
a LoRA adapter's id): a hash chain over full blocks. The links are exact: a block keeps
its parent and tokens, and a hit must match both, so two prefixes whose hashes collide
never alias (the later one is just not cached); and a node id is a counter that is
never reused. A block keeps its node id while it is cached; when it is evicted its node
dies, and blocks keyed under it as parent become unreachable (harmless; they go when
they are evicted).

Hybrid KV groups (`ipc/kv_groups.py`): a logical block is a page in each group. Group
0's pages carry the chain; the page of group `k > 0` is keyed under `("g", k, node)`,
the node of group 0's page for the same block, with a marker for tokens (`_mark`). A
hit of `L` blocks needs group 0's pages and every global group's for all `L`, and each
sliding group's for the blocks its window reaches from position `L * block_size` on:
`lookup` gives the longest such `L`, with -1 for the pages it needs not (`_groups_hit`).

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
from subway.scheduler.tokens import TOKEN_BYTES, token_bytes

_key_hash = hash  # of (parent node, tokens); a module global so that tests can force collisions


def companion_mark(group: int) -> bytes:
    """What a group-`group` page holds for tokens once keyed: never a block's token bytes."""
    return b"g%d" % group


class PrefixCache:
    """The prefix-cache half of `BlockManager` (its pool and tables are the other half),
    over the state `BlockManager.__init__` makes."""

    block_size: int
    num_blocks: int
    num_groups: int
    windows: tuple[int, ...]
    enable_caching: bool
    track_digests: bool
    sweep_slack: int
    claimed: dict[int, int]
    _tables: dict[int, list[int]]
    _ref: array
    _stamp: array
    _lru: deque[int]
    _num_evictable: int
    _cache: dict[int, int]
    _tokens: list[bytes | None]
    _key: array
    _parent: array
    _node: array
    _next_node: int
    _keyed: dict[int, tuple[int, int]]
    _digest: array
    _last_digest: dict[int, int]
    _digest_count: dict[int, int]
    _digest_changed: set[int]

    num_free_blocks: int  # (a property of BlockManager's)

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int]:  # BlockManager's
        raise NotImplementedError

    def lookup(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        max_blocks: int,
        root: int = 0,
    ) -> list[int]:
        """The cached blocks that hold the longest prefix of `prompt + output` (token arrays),
        at most `max_blocks` of them, on the chain from `root` (`cache_blocks`). With
        several KV groups, a flat table of pages (module doc). Changes nothing."""
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
        if not hits or (self.num_groups == 1 and not self.windows[0]):
            return hits
        return self._groups_hit(hits)

    def _companion(self, group: int, node: int) -> int:
        """Group `group`'s cached page of the block whose group-0 page has `node`, or -1."""
        b = self._cache.get(_key_hash(("g", group, node)))
        if b is None or self._parent[b] != node or self._tokens[b] != companion_mark(group):
            return -1
        return b

    def _groups_hit(self, heads: list[int]) -> list[int]:
        """The flat table of the longest hit whose every group has the pages it reads."""
        G, bs, nodes = self.num_groups, self.block_size, self._node
        windows = self.windows
        pages: dict[tuple[int, int], int] = {}

        def page(j: int, k: int) -> int:
            b = pages.get((j, k))
            if b is None:
                b = pages[(j, k)] = self._companion(k, nodes[heads[j]])
            return b

        n = len(heads)
        for k in range(1, G):
            if windows[k] == 0:
                n = next((j for j in range(n) if page(j, k) < 0), n)
        while n > 0:  # each sliding group needs the blocks its window reaches from n on
            miss = -1
            for k in range(1, G):
                if windows[k]:
                    lo = max(0, n * bs - windows[k] + 1) // bs
                    miss = next((j for j in range(n - 1, lo - 1, -1) if page(j, k) < 0), -1)
                    if miss >= 0:
                        break
            if miss < 0:
                break
            n = miss  # the hit ends before the missing page; look again from there
        firsts = [max(0, n * bs - w + 1) // bs if w else 0 for w in windows]
        table = []
        for j in range(n):
            # Group 0's too where it slides, but always the last: its node carries the chain.
            table.append(heads[j] if j >= firsts[0] or j == n - 1 else -1)
            for k in range(1, G):
                table.append(page(j, k) if j >= firsts[k] else -1)
        return table

    def admission_cost(self, hits: list[int], num_new_tokens: int) -> int:
        """Blocks that `allocate_with_prefix(_, hits, num_new_tokens)` takes out of
        `num_free_blocks`: the new ones, and the hits that nobody holds now."""
        ref = self._ref
        new = -(-num_new_tokens // self.block_size) * self.num_groups
        return new + sum(1 for b in hits if b >= 0 and ref[b] == 0)

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
            if b < 0:
                continue
            if ref[b] == 0:
                self._stamp[b] = 0  # its entry in the LRU queue is dead
                self._num_evictable -= 1
            ref[b] += 1
        if len(self._lru) > 2 * self._num_evictable + self.sweep_slack:  # mostly dead: sweep
            nb, stamps = self.num_blocks, self._stamp
            self._lru = deque(e for e in self._lru if stamps[e % nb] == e // nb)
        self._tables[seq_id] = list(hits)
        num_hit = len(hits) // self.num_groups
        self.claimed[seq_id] = num_hit * self.block_size
        if hits:
            self._keyed[seq_id] = (num_hit, self._node[hits[-self.num_groups]])
            if self.track_digests:
                self._last_digest[seq_id] = self._digest[hits[-self.num_groups]]
        self.allocate(seq_id, num_new_tokens)
        return list(self._tables[seq_id])

    def cache_blocks(
        self,
        seq_id: int,
        prompt: Sequence[int],
        output: Sequence[int],
        upto: int,
        root: int = 0,
    ) -> int:
        """Key the sequence's full blocks that lie within positions `0 .. upto - 1` (whose KV
        a sent plan computes, and whose tokens are known); returns the position from which
        the next block can be keyed. `root` is the parent of its first block: 0, or minus
        its LoRA adapter's id (an adapter's KV differs from the base model's for the same
        tokens, so each adapter's prefixes are a tree of their own).

        A block whose key is already cached elsewhere (the same prefix computed
        twice) stays private and uncached; the chain goes on from the cached one. A
        block whose group-0 page a window has released ends the keying for good.
        """
        table = self._tables.get(seq_id)
        bs = self.block_size
        if table is None or not self.enable_caching:
            return upto + bs
        G = self.num_groups
        count, node = self._keyed.get(seq_id, (0, root))
        end = min(upto // bs, len(table) // G)
        if count >= end:
            return (count + 1) * bs
        cache, nodes = self._cache, self._node
        parents, tokens = self._parent, self._tokens
        size = bs * TOKEN_BYTES
        data = token_bytes(prompt, output, count * bs, end * bs)
        track = self.track_digests
        digest = self._last_digest.get(seq_id, root) if track else 0
        for a in range(0, len(data), size):
            toks = data[a : a + size]
            b = table[count * G]
            if b < 0:
                break  # released behind a window: the chain cannot go on
            if track:
                digest = chain_digest(digest, toks)
            h = _key_hash((node, toks))
            hit = cache.get(h)
            if hit is None:
                if tokens[b] is not None:
                    raise AssertionError(f"block {b} of sequence {seq_id} is keyed twice")
                self._key_block(b, h, toks, node)
                nodes[b] = node = self._next_node
                self._next_node += 1
                if track:
                    self._digest[b] = digest
                    self._count_digest(digest, 1)
            elif parents[hit] == node and tokens[hit] == toks:
                node = nodes[hit]  # computed twice: the cached copy carries the chain
            else:  # a hash collision: leave this one uncached, on a chain of its own
                node = self._next_node
                self._next_node += 1
            for k in range(1, G):
                c = table[count * G + k]
                if c >= 0 and tokens[c] is None:
                    h = _key_hash(("g", k, node))
                    if h not in cache:
                        self._key_block(c, h, companion_mark(k), node)
                        nodes[c] = 0
            count += 1
        self._keyed[seq_id] = (count, node)
        if track:
            self._last_digest[seq_id] = digest
        return (count + 1) * bs

    def _key_block(self, b: int, h: int, toks: bytes, parent: int) -> None:
        self._cache[h] = b
        self._key[b] = h
        self._tokens[b] = toks
        self._parent[b] = parent

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
