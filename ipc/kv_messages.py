"""The messages of disaggregation, part of the contract and re-exported by `messages.py`:
a prefill engine's lease on a prompt's blocks and its release, the copy of them into a
decode engine (`KvImport`, `KvImported`), and the messages between a decode worker and
the prefill worker of its rank on another host (`worker/kv_remote.py`)."""

from __future__ import annotations

import msgspec


class KvLayout(msgspec.Struct, frozen=True):
    """One rank's KV caches: `num_layers` pairs (keys, values) of
    [num_blocks, block_size, num_kv_heads, width] tensors of `dtype`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    width: int  # a head vector's elements (head_dim, or head_dim + 4 int8 with its scale)
    dtype: str

    @property
    def cache_elems(self) -> int:
        return self.num_blocks * self.block_size * self.num_kv_heads * self.width

    def same_blocks(self, other: KvLayout) -> bool:
        """Whether a block of one is a block of the other (all but the block count)."""
        return msgspec.structs.replace(self, num_blocks=0) == msgspec.structs.replace(
            other, num_blocks=0
        )


class KvFetch(msgspec.Struct, tag="kv_fetch"):
    """A decode worker asks the prefill worker of its rank for blocks of that worker's
    caches, under a lease that the server checks after reading them: worker/kv_remote.py."""

    fetch_id: int
    blocks: list[int]
    # The lease the blocks are asked under (`KvLease`): the server answers only while it holds.
    slot: int = -1
    generation: int = 0
    incarnation: int = 0
    # The asker's rank, and whether this is the lease's last ask: once it is answered, the
    # server acknowledges the lease for that rank (ipc/kv_leases.py, `LeaseView.ack`).
    rank: int = 0
    last: bool = False


class KvBlocks(msgspec.Struct, tag="kv_blocks", omit_defaults=True):
    """The answer's first frame. Unless `error`, 2 * layout.num_layers raw frames follow,
    layer by layer, keys then values: each the asked blocks, in the order asked."""

    fetch_id: int
    layout: KvLayout | None = None
    error: str = ""


class KvLease(msgspec.Struct, array_like=True):
    """A prefill engine's hold on a finished request's full prompt blocks, for a decode
    engine to copy (disaggregation): freed on `ReleaseKv` or after `LEASE_S`.
    `source` is the engine's shared-memory prefix (its caches are `SOURCE_kvRANK`, on this
    host), or its ranks' KV addresses, comma-separated tcp://HOST:PORT (`--kv-addr`)."""

    lease_id: int
    source: str
    blocks: list[int]
    # Its place in the prefill engine's lease table (`worker/kv_share.py`, `LeaseTable`):
    # a copy is good only if the table still holds `generation` at `slot` after it, in the
    # table of that engine's `incarnation` (a restarted engine has another).
    slot: int = -1
    generation: int = 0
    incarnation: int = 0


LEASE_S = 30.0  # a lease nobody released is freed after this long


class ReleaseKv(msgspec.Struct, tag="release_kv"):
    """The decode side has its copy (or gave up): free the lease's blocks."""

    lease_id: int


class KvImported(msgspec.Struct, tag="kv_imported", omit_defaults=True):
    """Each rank's answer to a KvImport: whether its shard of the blocks was copied."""

    import_id: int
    rank: int
    ok: bool
    seconds: float = 0.0
    error: str = ""


class KvImport(msgspec.Struct, tag="kv_import"):
    """Copy blocks `src_blocks` of another engine's caches into this engine's `dst_blocks`,
    before any later plan runs: `source` as in `KvLease`."""

    import_id: int
    source: str
    src_blocks: list[int]
    dst_blocks: list[int]
    # The lease's `slot`, `generation` and `incarnation` (`KvLease`): checked after the copy.
    slot: int = -1
    generation: int = 0
    incarnation: int = 0
