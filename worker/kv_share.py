"""KV blocks from one engine to another on one host (disaggregated prefill and decode).

A prefill engine's worker keeps its KV caches in POSIX shared memory, `SOURCE_kvRANK`
(`SOURCE` is the engine's `subway_RUNID`): a header (the layout and the worker's
incarnation, a random number of this process, as JSON) and then each layer's key and
value caches. A decode engine's worker, told by its scheduler (`KvImport`), maps that
segment read-only and copies the leased blocks into blocks of its own: rank r copies rank
r's shard, so both engines must have the same tensor-parallel size, model and KV dtype
(the layouts are compared; a mismatch fails the copy, and the decode engine recomputes
the prompt).

Leases are checked, not trusted to time. The prefill engine's scheduler keeps a lease
table in shared memory, `SOURCE_kvleases` (`ipc/kv_leases.py`): a generation per slot,
cleared before the lease's blocks are freed, so before any later plan can write them. A
lease names its slot, generation and the table's incarnation; the importer checks the
slot before the copy and again after it, so a lease that ended during the copy (expired,
its blocks given to another prompt and rewritten) fails the import, whose blocks are
then never keyed into the decode engine's prefix cache. (A rewrite that the copy read
was written after the slot was cleared, so the check after the copy sees it cleared:
x86's store order, and the syscalls between the scheduler, the prefill worker and us.)

The importer acknowledges each lease in the table once it is done with it, made or
not, and the prefill engine frees it then (`ipc/kv_leases.py`).

A prefill engine restarted under the same run id makes new segments under the same
names, while a mapping of the old ones still reads the dead engine's memory. So every
import looks the names up again (another inode is another segment, mapped afresh) and
checks the incarnations: the lease's against the table's, the table's record of this
rank's worker against the segment's header.

Segments are made with every page reserved (`create_segment`): a /dev/shm too small is
a ShmSpaceError when the engine starts, never a SIGBUS at a page's first write later.
"""

from __future__ import annotations

import re
import time
import warnings

import msgspec
import torch

from subway.ipc.kv_leases import (
    HEADER_BYTES,
    KvShareError,
    LeaseView,
    LeaseViews,
    MappedSegment,
    SegmentHeader,
    close_segment,
    create_segment,
    new_incarnation,
    segment_name,
)
from subway.ipc.messages import KvImport, KvLayout
from subway.worker.kv_cache import allocate_kv_cache, kv_slot_layout
from subway.worker.model import KVCache

__all__ = ["KvShareError", "segment_name", "HEADER_BYTES"]  # re-exported: their old home

SOURCE_RE = re.compile(r"subway_[A-Za-z0-9_.-]{1,64}")  # an engine's shm prefix, nothing else
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8}  # fmt: skip


def _views(buf: memoryview, layout: KvLayout) -> list[KVCache]:
    dtype = KV_DTYPES[layout.dtype]
    shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.width)
    n = layout.cache_elems
    flat = torch.frombuffer(buf, dtype=dtype, offset=HEADER_BYTES, count=2 * layout.num_layers * n)
    caches = flat.view(layout.num_layers, 2, *shape)
    return [(caches[i, 0], caches[i, 1]) for i in range(layout.num_layers)]


def _segment_bytes(layout: KvLayout) -> int:
    itemsize = torch.empty(0, dtype=KV_DTYPES[layout.dtype]).element_size()
    return HEADER_BYTES + 2 * layout.num_layers * layout.cache_elems * itemsize


class SharedKvCache:
    """A prefill worker's caches, in a segment it owns (unlinked on close, or by its
    resource tracker if the process dies), its pages reserved and reading as zero."""

    def __init__(self, name: str, layout: KvLayout) -> None:
        self.name = name
        self.incarnation = new_incarnation()
        self._shm = create_segment(name, _segment_bytes(layout), f"the KV caches {name!r}")
        header = msgspec.json.encode(SegmentHeader(layout, self.incarnation))
        self._shm.buf[: len(header)] = header
        self.caches = _views(self._shm.buf, layout)

    def close(self) -> None:
        self.caches = []
        close_segment(self._shm)


def allocate(
    role: str, source: str, rank: int, num_layers: int, num_blocks: int, block_size: int,
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    huge_pages: bool, kv_int8: bool,
) -> tuple[list[KVCache], SharedKvCache | None]:  # fmt: skip
    """A worker's KV caches: in shared memory for a prefill engine on the CPU (others copy
    from them), else as `allocate_kv_cache` makes them."""
    if role != "prefill" or device.type != "cpu":
        caches = allocate_kv_cache(
            num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
            huge_pages, kv_int8=kv_int8,
        )  # fmt: skip
        return caches, None
    width, elem = kv_slot_layout(head_dim, dtype, kv_int8)
    name = {v: k for k, v in KV_DTYPES.items()}[elem]
    layout = KvLayout(num_layers, num_blocks, block_size, num_kv_heads, width, name)
    shared = SharedKvCache(segment_name(source, rank), layout)
    return shared.caches, shared


def layout_of(caches: list[KVCache]) -> KvLayout:
    k = caches[0][0]
    name = {v: n for n, v in KV_DTYPES.items()}[k.dtype]
    return KvLayout(len(caches), k.shape[0], k.shape[1], k.shape[2], k.shape[3], name)


class Source:
    """Another engine's caches, mapped for reading."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._m = MappedSegment(name, HEADER_BYTES)
        raw = bytes(self._m.map[:HEADER_BYTES]).rstrip(b"\0")
        try:
            header = msgspec.json.decode(raw, type=SegmentHeader)
        except msgspec.DecodeError as e:
            raise KvShareError(f"KV source {name!r}: a bad header ({e})") from None
        self.layout, self.incarnation = header.layout, header.incarnation
        if self.layout.dtype not in KV_DTYPES or len(self._m.map) < _segment_bytes(self.layout):
            raise KvShareError(f"KV source {name!r}: its header does not match its size")
        with warnings.catch_warnings():  # torch warns of a buffer it may not write: by design
            warnings.simplefilter("ignore", UserWarning)
            self.caches = _views(memoryview(self._m.map), self.layout)

    def current(self) -> bool:
        """Whether its name still names this segment (its engine did not restart)."""
        return self._m.current(self.name)


def copy_layer(dst: KVCache, src: KVCache, s_idx: torch.Tensor, d_idx: torch.Tensor) -> None:
    """One layer's blocks, keys then values."""
    for d, s in zip(dst, src, strict=True):
        d.index_copy_(0, d_idx, s.index_select(0, s_idx))


class Importer:
    """A decode worker's copies: each source mapped on first use, and again when its name
    has come to name another segment (its engine restarted)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._sources: dict[str, Source] = {}
        self._tables = LeaseViews()

    def run(self, caches: list[KVCache], msg: KvImport) -> tuple[bool, float, str]:
        """(ok, seconds, why not). Nothing of `caches` is written unless every check holds
        before the copy; a copy whose lease ended during it fails all the same (the blocks
        it wrote are the scheduler's to free: it keys a copy only if every rank made it)."""
        t0 = time.perf_counter()
        try:
            self._copy(caches, msg)
        except KvShareError as e:
            return False, time.perf_counter() - t0, str(e)
        return True, time.perf_counter() - t0, ""

    def _source(self, name: str) -> Source:
        src = self._sources.get(name)
        if src is None or not src.current():
            src = self._sources[name] = Source(name)
        return src

    def _copy(self, caches: list[KVCache], msg: KvImport) -> None:
        if not SOURCE_RE.fullmatch(msg.source):
            raise KvShareError(f"not a KV source name: {msg.source[:80]!r}")
        if msg.slot < 0:
            raise KvShareError("no lease named: nothing to check the copy against")
        name = segment_name(msg.source, self.rank)
        table = self._tables.view(msg.source)
        try:
            self._checked_copy(caches, msg, name, table)
        finally:  # made or not, this rank is done with the lease: its engine may free it
            table.ack(self.rank, msg.slot, msg.generation, msg.incarnation)

    def _checked_copy(
        self, caches: list[KVCache], msg: KvImport, name: str, table: LeaseView
    ) -> None:
        src = self._source(name)
        if self.rank >= len(table.workers) or table.workers[self.rank] != src.incarnation:
            raise KvShareError(f"KV source {name!r} is not of the engine that leased the blocks")
        mine = layout_of(caches)
        if not src.layout.same_blocks(mine):
            raise KvShareError(f"KV source {name!r} has another layout: {src.layout} vs {mine}")
        n = len(msg.src_blocks)
        if n != len(msg.dst_blocks) or n == 0:
            raise KvShareError(f"{n} source blocks for {len(msg.dst_blocks)} destinations")
        if len(set(msg.dst_blocks)) != n:
            raise KvShareError("a destination block named twice")
        for ids, limit in (
            (msg.src_blocks, src.layout.num_blocks),
            (msg.dst_blocks, mine.num_blocks),
        ):
            if min(ids) < 0 or max(ids) >= limit:
                raise KvShareError(f"a block id outside [0, {limit})")
        why = table.check(msg.slot, msg.generation, msg.incarnation)
        if why:
            raise KvShareError(why)
        s_idx = torch.tensor(msg.src_blocks, dtype=torch.long)
        d_idx = torch.tensor(msg.dst_blocks, dtype=torch.long)
        for dst, s in zip(caches, src.caches, strict=True):
            copy_layer(dst, s, s_idx, d_idx)
        why = table.check(msg.slot, msg.generation, msg.incarnation)  # after: see the docstring
        if why:
            raise KvShareError(f"{why} after the copy: its blocks may have been rewritten")
