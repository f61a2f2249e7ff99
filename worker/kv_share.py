"""KV blocks from one engine to another on one host (disaggregated prefill and decode).

A prefill engine's worker keeps its KV caches in POSIX shared memory, `SOURCE_kvRANK`
(`SOURCE` is the engine's `subway_RUNID`): a header (the layout, as JSON) and then each
layer's key and value caches. A decode engine's worker, told by its scheduler
(`KvImport`), maps that segment read-only and copies the leased blocks into blocks of
its own: rank r copies rank r's shard, so both engines must have the same
tensor-parallel size, model and KV dtype (the layouts are compared; a mismatch fails
the copy, and the decode engine recomputes the prompt).

The prefill side never writes a leased block: the blocks stay referenced by the lease
until the decode side's `ReleaseKv` (or the lease times out), so the copy reads what
the prefill computed. A prefill engine that dies takes its segment's name with it,
but not a mapping already made: a copy in progress still reads valid blocks.
"""

from __future__ import annotations

import mmap
import os
import re
import time
import warnings
from multiprocessing import shared_memory

import msgspec
import torch

from subway.ipc.messages import KvImport, KvLayout
from subway.worker.kv_cache import allocate_kv_cache, kv_slot_layout
from subway.worker.model import KVCache

HEADER_BYTES = 4096
SOURCE_RE = re.compile(r"subway_[A-Za-z0-9_.-]{1,64}")  # an engine's shm prefix, nothing else
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8}  # fmt: skip


class KvShareError(RuntimeError):
    """A copy that cannot be made: no such source, another layout, block ids out of range."""


def segment_name(source: str, rank: int) -> str:
    return f"{source}_kv{rank}"


def _views(buf: memoryview, layout: KvLayout) -> list[KVCache]:
    dtype = KV_DTYPES[layout.dtype]
    shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.width)
    n = layout.cache_elems
    flat = torch.frombuffer(buf, dtype=dtype, offset=HEADER_BYTES, count=2 * layout.num_layers * n)
    caches = flat.view(layout.num_layers, 2, *shape)
    return [(caches[i, 0], caches[i, 1]) for i in range(layout.num_layers)]


class SharedKvCache:
    """A prefill worker's caches, in a segment it owns (unlinked on close, or by its
    resource tracker if the process dies)."""

    def __init__(self, name: str, layout: KvLayout) -> None:
        itemsize = torch.empty(0, dtype=KV_DTYPES[layout.dtype]).element_size()
        size = HEADER_BYTES + 2 * layout.num_layers * layout.cache_elems * itemsize
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        header = msgspec.json.encode(layout)
        self._shm.buf[: len(header)] = header
        self.caches = _views(self._shm.buf, layout)
        for k, v in self.caches:  # fresh pages read as zero; written so that they are committed
            k.zero_()
            v.zero_()

    def close(self) -> None:
        self.caches = []
        try:
            self._shm.close()
        except BufferError:
            pass  # a tensor view lives on; unlinking still frees the name
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


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
        # Mapped by hand, read-only: a SharedMemory would register with this process's
        # resource tracker, which must never unlink another engine's segment.
        try:
            fd = os.open(os.path.join("/dev/shm", name), os.O_RDONLY)
        except OSError as e:
            raise KvShareError(f"no KV source {name!r}: {e}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise KvShareError(f"KV source {name!r}: {size} bytes, no header")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        raw = bytes(self._map[:HEADER_BYTES]).rstrip(b"\0")
        try:
            self.layout = msgspec.json.decode(raw, type=KvLayout)
        except msgspec.DecodeError as e:
            raise KvShareError(f"KV source {name!r}: a bad header ({e})") from None
        itemsize = torch.empty(0, dtype=KV_DTYPES.get(self.layout.dtype, torch.int8)).element_size()
        need = HEADER_BYTES + 2 * self.layout.num_layers * self.layout.cache_elems * itemsize
        if self.layout.dtype not in KV_DTYPES or size < need:
            raise KvShareError(f"KV source {name!r}: its header does not match its size")
        with warnings.catch_warnings():  # torch warns of a buffer it may not write: by design
            warnings.simplefilter("ignore", UserWarning)
            self.caches = _views(memoryview(self._map), self.layout)


class Importer:
    """A decode worker's copies: each source mapped once, on first use."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._sources: dict[str, Source] = {}

    def run(self, caches: list[KVCache], msg: KvImport) -> tuple[bool, float, str]:
        """(ok, seconds, why not). Nothing of `caches` is written unless every check holds."""
        t0 = time.perf_counter()
        try:
            self._copy(caches, msg)
        except KvShareError as e:
            return False, time.perf_counter() - t0, str(e)
        return True, time.perf_counter() - t0, ""

    def _copy(self, caches: list[KVCache], msg: KvImport) -> None:
        if not SOURCE_RE.fullmatch(msg.source):
            raise KvShareError(f"not a KV source name: {msg.source[:80]!r}")
        name = segment_name(msg.source, self.rank)
        src = self._sources.get(name)
        if src is None:
            src = self._sources[name] = Source(name)
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
        s_idx = torch.tensor(msg.src_blocks, dtype=torch.long)
        d_idx = torch.tensor(msg.dst_blocks, dtype=torch.long)
        for (dk, dv), (sk, sv) in zip(caches, src.caches, strict=True):
            dk.index_copy_(0, d_idx, sk.index_select(0, s_idx))
            dv.index_copy_(0, d_idx, sv.index_select(0, s_idx))
