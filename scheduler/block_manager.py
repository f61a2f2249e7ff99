"""The KV block pool: a fixed number of blocks of `block_size` token slots, handed to sequences.

Each sequence has a block table (a list of block ids, position p lives in
block `table[p // block_size]`) that grows as its tokens are planned.
Blocks carry reference counts so that a prefix cache can share full blocks
between sequences later: a hash chain over full blocks maps to block ids, a
block whose count drops to 0 but holds a cached prefix goes to an LRU of
evictable blocks instead of the free list, and `allocate` evicts from that LRU
when the free list is empty. None of that exists yet; `num_cached_blocks` is 0.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"bad pool: {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: the oldest freed goes first
        self._ref = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}  # token slots each sequence has claimed

    # ------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (empty if it holds none). Do not mutate it."""
        return self._tables.get(seq_id, [])

    def num_tokens(self, seq_id: int) -> int:
        return self._num_tokens.get(seq_id, 0)

    # ------------------------------------------------------------ growth

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_new_tokens` more tokens."""
        table = self._tables.get(seq_id)
        total = self._num_tokens.get(seq_id, 0) + num_new_tokens
        need = -(-total // self.block_size) - (len(table) if table is not None else 0)
        return need if need > 0 else 0

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens) <= len(self._free)

    def max_new_tokens(self, seq_id: int) -> int:
        """How many more tokens the sequence could claim with the blocks free now."""
        table = self._tables.get(seq_id)
        held = (len(table) if table is not None else 0) * self.block_size
        return held - self._num_tokens.get(seq_id, 0) + len(self._free) * self.block_size

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Claim slots for `num_new_tokens` more tokens; returns the blocks added to the table.

        Raises MemoryError (and changes nothing) if the free blocks do not suffice.
        """
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
        total = self._num_tokens.get(seq_id, 0) + num_new_tokens
        need = -(-total // self.block_size) - len(table)
        if need <= 0:
            self._num_tokens[seq_id] = total
            return []
        free = self._free
        if need > len(free):
            if not table:
                del self._tables[seq_id]
            raise MemoryError(f"sequence {seq_id} needs {need} blocks, {len(free)} are free")
        ref = self._ref
        new = [free.popleft() for _ in range(need)]
        for b in new:
            if ref[b] != 0:
                raise AssertionError(f"block {b} on the free list has {ref[b]} references")
            ref[b] = 1
        table.extend(new)
        self._num_tokens[seq_id] = total
        return new

    def free(self, seq_id: int) -> int:
        """Return the sequence's blocks to the pool; returns how many were returned.

        Freeing a sequence that holds nothing is a no-op; a block whose count is
        already 0 raises (a double free).
        """
        table = self._tables.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)
        if not table:
            return 0
        ref = self._ref
        free = self._free
        for b in table:
            n = ref[b]
            if n <= 0:
                raise AssertionError(f"double free of block {b} (sequence {seq_id})")
            ref[b] = n - 1
            if n == 1:
                free.append(b)
        return len(table)

    def check(self) -> None:
        """Verify the invariants (for tests): every block is free xor referenced by its tables."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                counts[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if counts[b] != self._ref[b]:
                raise AssertionError(f"block {b}: ref {self._ref[b]}, in {counts[b]} tables")
            if (b in free) == (counts[b] > 0):
                raise AssertionError(f"block {b}: free={b in free}, refs={counts[b]}")
        for seq_id, table in self._tables.items():
            n = self._num_tokens.get(seq_id, 0)
            if len(table) != -(-n // self.block_size):
                raise AssertionError(f"sequence {seq_id}: {len(table)} blocks for {n} tokens")
