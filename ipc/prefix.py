"""Content digests of a prompt's full KV blocks: how the frontend and the schedulers name a
cached prefix alike, for prefix-aware routing across data-parallel engines.

A block's digest chains its parent's: `digest(block i) = blake2b(digest(block i-1) ||
tokens of block i)`, 8 bytes, signed, the first block's parent 0. Equal digests mean an
equal prefix up to a 2**-64 collision, which costs only a worse routing choice: the
scheduler's own prefix cache checks every hit token by token (`BlockManager.lookup`).
A scheduler reports the digests its prefix cache gains and loses (`CacheEvents`); the
frontend keeps one set per engine and walks a prompt's chain through it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

TOKEN_TYPE = "i"  # as the block manager stores a block's tokens: raw int32


def chain_digest(parent: int, block_tokens: bytes) -> int:
    h = blake2b(parent.to_bytes(8, "little", signed=True), digest_size=8)
    h.update(block_tokens)
    return int.from_bytes(h.digest(), "little", signed=True)


def prompt_digests(ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The digests of the prompt's full blocks, first to last (at most `max_blocks`)."""
    n = len(ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    data = array(TOKEN_TYPE, ids[: n * block_size]).tobytes()
    size = block_size * array(TOKEN_TYPE).itemsize
    out: list[int] = []
    d = 0
    for a in range(0, len(data), size):
        d = chain_digest(d, data[a : a + size])
        out.append(d)
    return out
