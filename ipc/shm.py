"""Shared-memory token buffers: int32 token ids that processes on one host read in place.

One process owns a buffer: it creates it and unlinks it on close. Others attach.
A crash of the owner still leaves nothing behind in /dev/shm: the owner's
multiprocessing resource tracker unlinks what it registered when the owner
dies. Attaching processes unregister from their own tracker, or it would unlink
the owner's buffer when they exit (CPython < 3.13 registers attaches too).
"""

from __future__ import annotations

from collections import deque
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from subway.ipc.messages import TokenRef


class TokenBuffer:
    """A fixed array of int32 token ids in POSIX shared memory."""

    def __init__(self, name: str, capacity: int, create: bool) -> None:
        self.name = name
        self.owner = create
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=capacity * 4)
        else:
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.capacity = self._shm.size // 4
        self.array = np.ndarray((self.capacity,), dtype=np.int32, buffer=self._shm.buf)

    @classmethod
    def create(cls, name: str, capacity: int) -> TokenBuffer:
        return cls(name, capacity, create=True)

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
