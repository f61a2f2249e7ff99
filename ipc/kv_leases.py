"""Disaggregation's shared memory without torch: segments made with their pages reserved,
the header of a prefill worker's KV segment, and a prefill engine's lease table.

A prefill engine's scheduler keeps its leases' generations in `SOURCE_kvleases`
(`LeaseTable`): a header of 8-byte words (magic, the table's incarnation, its slots, its
ranks, then each rank's worker incarnation), one 8-byte generation per slot (0: no
lease), then one 8-byte acknowledgement per rank and slot. A lease (`KvLease`) names its
slot, generation and the table's incarnation. The scheduler clears a slot before it
frees the lease's blocks, so before any plan that could write them is sent; an importer
checks the slot before its copy and again after it (`worker/kv_share.py`,
`worker/kv_remote.py`). Incarnations are random numbers made by each process that makes
a segment: a prefill engine restarted under the same run id makes segments of the same
names but other incarnations, and the importer, which looks the names up again at every
import (`MappedSegment.current`), tells them apart.

When an importer is done with a lease (the blocks copied, or the copy given up), it
writes the lease's generation into its rank's acknowledgement; the scheduler frees a
lease that every rank has acknowledged on its next turn (`scheduler/handoff.py`), not
at the frontend's `ReleaseKv`, which comes with the decode engine's first token (the
frontend cannot release earlier: that delta also frees the request's prompt in the
frontend's prompt buffer, which the decode worker reads when it first runs the request).
An acknowledgement can only free a lease early, and a copy that outlives its lease fails
its check, so no writer of acknowledgements can make a copy read rewritten blocks.

Segments are made with every page reserved (`create_segment`, as `ipc/shm.py` reserves
the token buffers): a /dev/shm too small is a ShmSpaceError there, naming the sizes,
where a segment only sized by `ftruncate` would SIGBUS at the first write of a page it
could not get.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory

import msgspec

from subway.ipc.messages import KvLayout
from subway.ipc.shm import SHM_DIR, reserve

HEADER_BYTES = 4096  # a worker segment's header, before its caches
LEASES_SUFFIX = "_kvleases"
MAX_RANKS = 256  # in a lease table's header
TABLE_HEADER = 8 * (4 + MAX_RANKS)
_MAGIC = int.from_bytes(b"subwayL1", "little")


class KvShareError(RuntimeError):
    """A copy that cannot be made: no such source, another layout, block ids out of range,
    a lease no longer held; or a segment whose name is taken."""


class SegmentHeader(msgspec.Struct):
    """A prefill worker's KV segment's header (JSON): its layout, and the incarnation of
    the worker that made it."""

    layout: KvLayout
    incarnation: int


def segment_name(source: str, rank: int) -> str:
    return f"{source}_kv{rank}"


def lease_table_name(source: str) -> str:
    return f"{source}{LEASES_SUFFIX}"


def new_incarnation() -> int:
    """A random 63-bit number, never 0."""
    return secrets.randbits(63) | 1


def create_segment(name: str, size: int, what: str) -> shared_memory.SharedMemory:
    """A new segment of `size` bytes, its pages reserved now (`ipc/shm.py`, `reserve`):
    ShmSpaceError, naming `what`, the size and /dev/shm, when /dev/shm cannot hold it
    (and then nothing is left behind); KvShareError when the name is taken."""
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        raise KvShareError(
            f"shared memory {name!r} exists already: another engine runs with this run id, "
            "or one that died left it (remove it)"
        ) from None
    try:
        reserve(shm, size, what, "or give the KV caches less (--kv-cache-memory, --num-kv-blocks)")
    except OSError:
        close_segment(shm)
        raise
    return shm


def close_segment(shm: shared_memory.SharedMemory) -> None:
    """Unmap (unless a view lives on) and unlink a segment this process made."""
    try:
        shm.close()
    except BufferError:
        pass  # a view lives on; unlinking still frees the name
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def read_incarnation(name: str) -> int:
    """The incarnation in worker segment `name`'s header; 0 if there is none here."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError:
        return 0
    try:
        return msgspec.json.decode(raw.rstrip(b"\0"), type=SegmentHeader).incarnation
    except msgspec.DecodeError:
        return 0


class LeaseTable:
    """A prefill engine's leases, as its scheduler keeps them for importers to check:
    `grant` fills a slot with a new generation, `revoke` clears it; importers write
    their acknowledgements into it (`LeaseView.ack`), which `acked` reads. The scheduler
    is the one writer of everything else; others map it (`LeaseView`)."""

    def __init__(self, source: str, slots: int, workers: list[int]) -> None:
        """`workers`: each rank's worker incarnation (`read_incarnation`; 0 if unknown here)."""
        if not 0 < len(workers) <= MAX_RANKS or slots <= 0:
            raise ValueError(f"a lease table of {slots} slots for {len(workers)} ranks")
        self.name = lease_table_name(source)
        self.incarnation = new_incarnation()
        self.slots, self.ranks = slots, len(workers)
        size = table_bytes(slots, self.ranks)
        self._shm = create_segment(self.name, size, "a lease table")
        words = self._shm.buf[:TABLE_HEADER].cast("Q")
        words[1], words[2], words[3] = self.incarnation, slots, self.ranks
        for r, inc in enumerate(workers):
            words[4 + r] = inc
        words[0] = _MAGIC  # last: a reader never takes a half-made header for a table
        words.release()
        self._gens: memoryview | None = self._shm.buf[TABLE_HEADER : TABLE_HEADER + 8 * slots]
        self._gens = self._gens.cast("Q")
        self._acks: memoryview | None = self._shm.buf[TABLE_HEADER + 8 * slots : size].cast("Q")
        self._free = list(range(slots - 1, -1, -1))
        self._next = 1

    def grant(self) -> tuple[int, int] | None:
        """(slot, generation) of a new lease; None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        gen, self._next = self._next, self._next + 1
        self._gens[slot] = gen
        return slot, gen

    def revoke(self, slot: int) -> None:
        """The lease in `slot` ends: importers' checks fail from now on."""
        self._gens[slot] = 0
        self._free.append(slot)

    def acked(self, slot: int, generation: int) -> bool:
        """Whether every rank's importer is done with the lease (acks of another generation,
        an earlier lease of the slot, do not count)."""
        acks, n = self._acks, self.slots
        return all(acks[r * n + slot] == generation for r in range(self.ranks))

    def close(self) -> None:
        """Unlink the table (once; later calls do nothing): every lease in it ends."""
        if self._gens is None:
            return
        self._gens.release()
        self._acks.release()
        self._gens = self._acks = None
        close_segment(self._shm)


def table_bytes(slots: int, ranks: int) -> int:
    """A lease table's size: its header, a generation and then each rank's ack per slot."""
    return TABLE_HEADER + 8 * slots * (1 + ranks)


class MappedSegment:
    """Another process's segment, mapped by hand: a SharedMemory would register with this
    process's resource tracker, which must never unlink another engine's segment."""

    def __init__(self, name: str, min_size: int, writable: bool = False) -> None:
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise KvShareError(f"no KV source {name!r}: {e}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < min_size:
                raise KvShareError(f"KV source {name!r}: {st.st_size} bytes, no header")
            self.identity = (st.st_dev, st.st_ino)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(fd, st.st_size, prot=prot)
        finally:
            os.close(fd)

    def current(self, name: str) -> bool:
        """Whether `name` still names this segment (not a newer one, nor none)."""
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


class LeaseView:
    """Another engine's lease table: its generations read, acknowledgements written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._m = MappedSegment(name, TABLE_HEADER, writable=True)
        words = memoryview(self._m.map)[:TABLE_HEADER].cast("Q")
        magic, self.incarnation, self.slots, self.ranks = words[0], words[1], words[2], words[3]
        if magic != _MAGIC or not 0 < self.ranks <= MAX_RANKS:
            raise KvShareError(f"lease table {name!r}: a bad header")
        size = table_bytes(self.slots, self.ranks)
        if len(self._m.map) < size:
            raise KvShareError(f"lease table {name!r}: its header does not match its size")
        self.workers = list(words[4 : 4 + self.ranks])
        whole = memoryview(self._m.map)
        self._gens = whole[TABLE_HEADER : TABLE_HEADER + 8 * self.slots].cast("Q")
        self._acks = whole[TABLE_HEADER + 8 * self.slots : size].cast("Q")

    def current(self) -> bool:
        return self._m.current(self.name)

    def check(self, slot: int, generation: int, incarnation: int) -> str:
        """Why a lease is not held now; "" when it is."""
        if incarnation != self.incarnation:
            return f"the lease is of another incarnation of its engine than {self.name!r}"
        if not 0 <= slot < self.slots or generation <= 0:
            return f"lease slot {slot} outside [0, {self.slots})"
        if self._gens[slot] != generation:
            return "the lease is no longer held"
        return ""

    def ack(self, rank: int, slot: int, generation: int, incarnation: int) -> None:
        """Rank `rank` is done with the lease (copied, or given up): once every rank is, its
        engine frees it, not waiting for the frontend's ReleaseKv. Another table's lease, or
        one out of range, is ignored."""
        if incarnation == self.incarnation and 0 <= slot < self.slots and 0 <= rank < self.ranks:
            self._acks[rank * self.slots + slot] = generation


class LeaseViews:
    """Lease tables mapped on first use, and again when a name has come to name another
    segment (its engine restarted)."""

    def __init__(self) -> None:
        self._views: dict[str, LeaseView] = {}

    def view(self, source: str) -> LeaseView:
        """`source`: the engine's shm prefix. Raises KvShareError when it has no table here."""
        name = lease_table_name(source)
        v = self._views.get(name)
        if v is None or not v.current():
            v = self._views[name] = LeaseView(name)
        return v
