"""Whole KV blocks moved from one worker's cache to another's (disaggregated prefill/decode).

Blocks travel as bytes in one order, block-major: for each block, for each layer, the key
block then the value block, each `[block_size, kv_heads, width]` of the cache's element type
in the host's byte order. `pack_blocks` gathers them, `unpack_blocks` scatters them into
other ids of a cache with the same `KvLayout`; on one host through a `KvStaging` segment,
across hosts as two ZeroMQ frames (`encode_frames`). Nothing is pickled; every length,
offset and block id is checked before use.
"""

from __future__ import annotations

import contextlib
import operator
import struct
import uuid
import warnings
import zlib
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Annotated, Any

import msgspec
import torch

from subway.worker.model import KVCache

Positive = Annotated[int, msgspec.Meta(gt=0)]


class KvTransferError(ValueError):
    """A transfer refused: mismatched layouts, bad block ids, wrong lengths, corrupt frames."""


class KvLayout(msgspec.Struct, frozen=True, array_like=True):
    """What two caches share for their blocks' bytes to mean the same (pool sizes may differ)."""

    num_layers: Positive
    block_size: Positive
    num_kv_heads: Positive
    width: Positive
    dtype: str  # a torch dtype's name: "float32", "bfloat16", "int8" (8-bit KV) ...
    block_bytes: Positive  # one block, all layers, keys and values

    def check(self) -> None:
        """Refuse a layout whose dtype is unknown or whose `block_bytes` disagree with the rest."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KvTransferError(f"unknown KV dtype {self.dtype!r}")
        slot = self.block_size * self.num_kv_heads * self.width * dtype.itemsize
        if self.block_bytes != (expected := 2 * self.num_layers * slot):
            raise KvTransferError(f"{self.block_bytes} bytes a block, its shape says {expected}")


def layout_of(kv_caches: Sequence[KVCache]) -> KvLayout:
    """The layout of a cache from `allocate_kv_cache`; refuses caches that are not uniform."""
    if not kv_caches:
        raise KvTransferError("a KV cache with no layers")
    first = kv_caches[0][0]
    if first.dim() != 4:
        raise KvTransferError(f"a KV cache tensor of shape {tuple(first.shape)}, expected 4 dims")
    # Contiguous: the byte views must alias the cache (a strided tensor's reshape copies).
    want = (first.shape, first.dtype, first.device, True)
    for layer, pair in enumerate(kv_caches):
        if any((t.shape, t.dtype, t.device, t.is_contiguous()) != want for t in pair):
            raise KvTransferError(f"layer {layer}'s caches: not contiguous or not layer 0's")
    _, block_size, heads, width = first.shape
    size = 2 * len(kv_caches) * first.shape[1:].numel() * first.element_size()
    name = str(first.dtype).removeprefix("torch.")
    return KvLayout(len(kv_caches), block_size, heads, width, name, size)


def _check_ids(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """Block ids as ints, each once and within the pool (a bad index on CUDA kills the context)."""
    try:
        ids = [operator.index(b) for b in block_ids]
    except TypeError as e:
        raise KvTransferError(f"block ids must be integers: {e}") from None
    if len(set(ids)) != len(ids):
        raise KvTransferError("duplicate block ids")
    if bad := [b for b in ids if not 0 <= b < num_blocks]:
        raise KvTransferError(f"block ids {bad[:8]} outside the pool's {num_blocks} blocks")
    return ids


def _byte_views(kv_caches: Sequence[KVCache]) -> list[torch.Tensor]:
    """Each cache tensor as uint8 `[num_blocks, its block's bytes]`, aliasing it; payload order."""
    return [t.view(torch.uint8).view(t.shape[0], -1) for pair in kv_caches for t in pair]


def _as_bytes(buf: Any) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise KvTransferError(f"a {type(buf).__name__} is not a buffer") from None
    if not view.c_contiguous:
        raise KvTransferError("a KV payload buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _whole_blocks(data: Any, layout: KvLayout) -> tuple[memoryview, int]:
    view = _as_bytes(data)
    num_blocks, rest = divmod(view.nbytes, layout.block_bytes)
    if rest:
        raise KvTransferError(f"{view.nbytes} bytes are not whole blocks")
    return view, num_blocks


def pack_blocks(
    kv_caches: Sequence[KVCache], block_ids: Sequence[int], out: memoryview | None = None
) -> memoryview:
    """The bytes of `block_ids` (module docstring's order): one `index_select` per layer and
    k/v into `out` (writable, exactly that long: a `KvStaging.view`) or a new buffer. A cache
    on a device is gathered there, then copied to the host once."""
    layout = layout_of(kv_caches)
    views = _byte_views(kv_caches)
    ids = _check_ids(block_ids, views[0].shape[0])
    total = len(ids) * layout.block_bytes
    result = _as_bytes(torch.empty(total, dtype=torch.uint8).numpy() if out is None else out)
    if result.readonly or result.nbytes != total:
        raise KvTransferError(f"`out` must be writable and {total} bytes, not {result.nbytes}")
    if total == 0:
        return result  # torch.frombuffer refuses an empty buffer
    host = torch.frombuffer(result, dtype=torch.uint8)
    device = views[0].device
    dst = host if device.type == "cpu" else torch.empty(total, dtype=torch.uint8, device=device)
    dst = dst.view(len(ids), len(views), -1)
    index = torch.tensor(ids, dtype=torch.int64, device=device)
    for i, view in enumerate(views):
        torch.index_select(view, 0, index, out=dst[:, i])
    if dst.device.type != "cpu":
        host.copy_(dst.view(-1))
    return result


def unpack_blocks(
    kv_caches: Sequence[KVCache], block_ids: Sequence[int], data: Any, layout: KvLayout
) -> None:
    """Scatter `data` (`pack_blocks`'s, under the sender's `layout`) into `block_ids`.
    Everything is checked before the first write: a refused input changes nothing."""
    if layout != (local := layout_of(kv_caches)):
        raise KvTransferError(f"sender's KV layout {layout} differs from this cache's {local}")
    views = _byte_views(kv_caches)
    ids = _check_ids(block_ids, views[0].shape[0])
    payload = _as_bytes(data)
    if payload.nbytes != len(ids) * layout.block_bytes:
        raise KvTransferError(f"{payload.nbytes} bytes for {len(ids)} blocks")
    if not ids:
        return
    with warnings.catch_warnings():
        # Only read: torch warns (once a process) that it cannot mark the tensor read-only.
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        src = torch.frombuffer(payload, dtype=torch.uint8)
    device = views[0].device
    src = src.to(device).view(len(ids), len(views), -1)
    index = torch.tensor(ids, dtype=torch.int64, device=device)
    for i, view in enumerate(views):
        view.index_copy_(0, index, src[:, i])


def staging_name(run_id: str) -> str:
    """A fresh segment name carrying the run id, as the engine's other shm names do."""
    return f"subway_{run_id}_kvstage_{uuid.uuid4().hex[:8]}"


_MAGIC = b"SUBWAYKV"
_HEADER = 256  # _PREFIX (magic, n), n bytes of msgpack (layout, capacity); then the slots
_PREFIX = struct.Struct("<8sI")


class KvStaging:
    """`capacity` block slots in shared memory, between workers of one host. The sender
    `create`s it and alone unlinks it (on `close`, or its resource tracker if it dies);
    receivers `open` it by name, refused unless its layout (stored in it) is theirs."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: KvLayout, capacity: int,
                 owner: bool) -> None:  # fmt: skip
        self._shm: shared_memory.SharedMemory | None = shm
        self.name, self.layout, self.capacity, self.owner = shm.name, layout, capacity, owner

    @classmethod
    def create(cls, name: str, layout: KvLayout, capacity: int) -> KvStaging:
        layout.check()
        if capacity <= 0:
            raise KvTransferError(f"a staging buffer of {capacity} blocks")
        meta = msgspec.msgpack.encode((layout, capacity))  # a checked dtype name: < 100 bytes
        size = _HEADER + capacity * layout.block_bytes
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            raise KvTransferError(f"a shared-memory segment {name!r} already exists") from None
        shm.buf[: _PREFIX.size] = _PREFIX.pack(_MAGIC, len(meta))
        shm.buf[_PREFIX.size : _PREFIX.size + len(meta)] = meta
        return cls(shm, layout, capacity, owner=True)

    @classmethod
    def open(cls, name: str, layout: KvLayout) -> KvStaging:
        """Attach to the sender's segment; refuse it unless it holds blocks of `layout`."""
        try:
            shm = shared_memory.SharedMemory(name=name, create=False)
        except FileNotFoundError:
            raise KvTransferError(f"no shared-memory segment {name!r}") from None
        # CPython < 3.13 registers attaches too: our tracker would unlink the owner's segment.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            magic, n = _PREFIX.unpack_from(shm.buf)
            if magic != _MAGIC or n > _HEADER - _PREFIX.size or shm.size < _HEADER:
                raise KvTransferError(f"segment {name!r} is not a KV staging buffer")
            meta = bytes(shm.buf[_PREFIX.size : _PREFIX.size + n])
            theirs, capacity = msgspec.msgpack.decode(meta, type=tuple[KvLayout, Positive])
            if theirs != layout:
                raise KvTransferError(f"staging layout {theirs} differs from this cache's {layout}")
            if shm.size < _HEADER + capacity * layout.block_bytes:
                raise KvTransferError(f"segment {name!r} is shorter than its capacity")
        except (KvTransferError, struct.error, msgspec.MsgspecError) as e:
            shm.close()
            raise KvTransferError(str(e)) from None
        return cls(shm, layout, capacity, owner=False)

    def _span(self, slot_offset: int, num_blocks: int) -> slice:
        if self._shm is None:
            raise KvTransferError("the staging buffer is closed")
        if not (0 <= slot_offset and 0 <= num_blocks and slot_offset + num_blocks <= self.capacity):
            raise KvTransferError(f"{num_blocks} slots at {slot_offset}: outside {self.capacity}")
        start = _HEADER + slot_offset * self.layout.block_bytes
        return slice(start, start + num_blocks * self.layout.block_bytes)

    def view(self, slot_offset: int, num_blocks: int) -> memoryview:
        """The slots in place, writable (`pack_blocks(out=)`, `unpack_blocks`): no copy.
        Drop it before `close`: a live view keeps the mapping (not the name) alive."""
        span = self._span(slot_offset, num_blocks)
        return self._shm.buf[span]  # type: ignore[union-attr]  # _span refuses a closed one

    def write(self, slot_offset: int, data: Any) -> None:
        """Copy whole blocks' bytes into the slots from `slot_offset`."""
        payload, num_blocks = _whole_blocks(data, self.layout)
        self.view(slot_offset, num_blocks)[:] = payload

    def read(self, slot_offset: int, num_blocks: int) -> bytes:
        """A copy of `num_blocks` slots from `slot_offset` (`view` reads them in place)."""
        return bytes(self.view(slot_offset, num_blocks))

    def close(self) -> None:
        """Detach, and unlink if this process created it. Idempotent."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        with contextlib.suppress(BufferError):  # a view is alive: the mapping goes with it
            shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # frees the name even while a view holds the mapping

    def __enter__(self) -> KvStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KvBlocksHeader(msgspec.Struct, frozen=True, array_like=True, tag="kv_blocks"):
    """The first of the two frames that carry blocks over ZeroMQ; the payload is the second."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    layout: KvLayout
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=2**32)]  # zlib.crc32 of the payload


def header_for(request_id: str, layout: KvLayout, payload: Any) -> KvBlocksHeader:
    """The header of `payload` (whole blocks of `layout`), its checksum computed."""
    data, num_blocks = _whole_blocks(payload, layout)
    return KvBlocksHeader(request_id, layout, num_blocks, zlib.crc32(data))


def encode_frames(header: KvBlocksHeader, payload: Any) -> list[bytes | memoryview]:
    """`[header, payload]` for `send_multipart`, the payload not copied. Checks the length;
    the checksum is `header_for`'s, not recomputed."""
    data = _as_bytes(payload)
    if data.nbytes != header.num_blocks * header.layout.block_bytes:
        raise KvTransferError(f"{data.nbytes} bytes for {header.num_blocks} blocks in the header")
    return [msgspec.msgpack.encode(header), data]


def decode_frames(frames: Sequence[Any]) -> tuple[KvBlocksHeader, memoryview]:
    """The header and payload of received frames (bytes, memoryviews or `zmq.Frame`s), checked:
    two frames, a well-formed header with a consistent layout, the length, the checksum."""
    if len(frames) != 2:
        raise KvTransferError(f"{len(frames)} frames, expected 2 (header, payload)")
    try:
        header = msgspec.msgpack.decode(_as_bytes(frames[0]), type=KvBlocksHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise KvTransferError(f"bad KV blocks header: {e}") from None
    header.layout.check()
    payload = _as_bytes(frames[1])
    if payload.nbytes != (expected := header.num_blocks * header.layout.block_bytes):
        raise KvTransferError(f"payload of {payload.nbytes} bytes, header says {expected}")
    if zlib.crc32(payload) != header.crc32:
        raise KvTransferError("payload checksum mismatch")
    return header, payload
