"""Shared-memory token buffers: int32 token ids that processes on one host read in place.

One process owns a buffer: it creates it and unlinks it on close. Others attach.
A crash of the owner still leaves nothing behind in /dev/shm: the owner's
multiprocessing resource tracker unlinks what it registered when the owner
dies. Attaching processes unregister from their own tracker, or it would unlink
the owner's buffer when they exit (CPython < 3.13 registers attaches too).

A new buffer's pages are committed when it is made (`reserve`): a shared-memory
file is sparse until written, so without that a full /dev/shm would surface as a
SIGBUS on some later write, in the middle of serving. With it, it is a
`ShmSpaceError` at start, naming the size and /dev/shm.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from subway.ipc.messages import TokenRef

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux (shm_open's tmpfs)
_ZEROS = bytes(1 << 20)  # what the fallback writes, a MiB at a time
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class ShmSpaceError(OSError):
    """Shared memory could not be reserved: /dev/shm (or memory) has no room for it."""


def _free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _no_room(err: OSError, nbytes: int, what: str, hint: str) -> ShmSpaceError:
    free = _free_bytes()
    room = f"{free} bytes free there" if free is not None else "its free space unknown"
    msg = (
        f"cannot reserve {nbytes} bytes of shared memory{' for ' + what if what else ''} "
        f"in {SHM_DIR} ({room}): {err.strerror or err}; give {SHM_DIR} more room "
        f"(docker run --shm-size=...){'; ' + hint if hint else ''}"
    )
    return ShmSpaceError(err.errno or errno.ENOSPC, msg)


def _write_zeros(fd: int, nbytes: int) -> None:
    """Commit pages by writing them (through the fd, so that no room is an error, not a
    SIGBUS): for file systems without fallocate."""
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, _ZEROS[: min(len(_ZEROS), nbytes - done)], done)


def reserve(
    fd_or_shm: int | shared_memory.SharedMemory, nbytes: int, what: str = "", hint: str = ""
) -> None:
    """Commit the first `nbytes` of a shared-memory file (an fd, or a SharedMemory) now,
    so that no later write through a mapping of it can fault for lack of room. Raises
    ShmSpaceError (an OSError, errno ENOSPC as a rule) naming `what`, the size and
    /dev/shm, with `hint` (what the user may change) appended."""
    fd = fd_or_shm if isinstance(fd_or_shm, int) else fd_or_shm._fd  # type: ignore[attr-defined]
    if nbytes <= 0:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno not in _NO_FALLOCATE:
                raise
            _write_zeros(fd, nbytes)
    except OSError as e:
        raise _no_room(e, nbytes, what, hint) from None


class TokenBuffer:
    """A fixed array of int32 token ids in POSIX shared memory."""

    def __init__(self, name: str, capacity: int, create: bool, hint: str = "") -> None:
        self.name = name
        self.owner = create
        if create:
            self._shm = _create_reserved(name, capacity * 4, hint)
        else:
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.capacity = self._shm.size // 4
        self.array = np.ndarray((self.capacity,), dtype=np.int32, buffer=self._shm.buf)

    @classmethod
    def create(cls, name: str, capacity: int, hint: str = "") -> TokenBuffer:
        """A new buffer, its pages committed: ShmSpaceError (with `hint`) when /dev/shm
        has no room for it, and then nothing is left behind."""
        return cls(name, capacity, create=True, hint=hint)

    @classmethod
    def attach(cls, name: str) -> TokenBuffer:
        return cls(name, 0, create=False)

    def write(self, offset: int, ids) -> None:
        self.array[offset : offset + len(ids)] = ids

    def read(self, offset: int, length: int) -> np.ndarray:
        """A view, not a copy: copy it if the buffer may be rewritten while you hold it."""
        return self.array[offset : offset + length]

    def close(self) -> None:
        if self._shm is None:
            return
        self.array = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:
            pass  # a numpy view is still alive somewhere; unlinking still frees the name
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self._shm = None  # type: ignore[assignment]


def _create_reserved(name: str, nbytes: int, hint: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    try:
        reserve(shm, nbytes, what=name, hint=hint)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm


def resolve(ref: TokenRef, buffer: TokenBuffer | None) -> list[int]:
    """The ids a TokenRef names, as a fresh list."""
    if ref.ids is not None:
        return list(ref.ids)
    if buffer is None:
        raise ValueError("token ids are in shared memory, but no buffer is attached")
    if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > buffer.capacity:
        raise ValueError(
            f"a run [{ref.offset}, {ref.offset + ref.length}) outside the buffer's "
            f"{buffer.capacity} ids"
        )
    return buffer.read(ref.offset, ref.length).tolist()


class RingAllocator:
    """Hands out contiguous runs of a buffer in ring order; runs may be freed in any order.

    The tail only moves past runs that were freed, so a long-lived run holds the
    space after it until it is freed; `alloc` then returns None and the caller
    sends ids inline instead.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.head = 0  # next free offset
        self.live: deque[list] = deque()  # [offset, length, freed] in allocation order
        self.by_offset: dict[int, list] = {}

    def _used_until(self) -> int | None:
        while self.live and self.live[0][2]:
            self.by_offset.pop(self.live.popleft()[0], None)
        return self.live[0][0] if self.live else None

    def alloc(self, length: int) -> int | None:
        if length <= 0 or length > self.capacity:
            return None
        tail = self._used_until()
        if tail is None:
            self.head = 0
            start = 0
        elif self.head > tail:  # used region is [tail, head): free is [head, cap) + [0, tail)
            if self.head + length <= self.capacity:
                start = self.head
            elif length < tail:
                start = 0
            else:
                return None
        else:  # wrapped: used is [tail, cap) + [0, head): free is [head, tail)
            if self.head + length < tail:
                start = self.head
            else:
                return None
        run = [start, length, False]
        self.live.append(run)
        self.by_offset[start] = run
        self.head = start + length
        return start

    def free(self, offset: int) -> None:
        run = self.by_offset.get(offset)
        if run is not None:
            run[2] = True
