"""The frontend's prompt ring: prompt ids in shared memory, written once, read in place.

This frontend owns the buffer (creates and unlinks it); the workers attach to
it by name and read a prompt's run where it lies, so an AddRequest carries only
its offset and length. A run is freed at its request's first delta: by then the
workers have read it. Ids go inline when the ring is full, or without shared
memory (`--no-shm`, several hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from subway.ipc.config import IpcConfig
from subway.ipc.messages import TokenRef
from subway.ipc.shm import RingAllocator, TokenBuffer


class PromptRing:
    """Prompt ids in shared memory, one run per request; inline ids without a buffer or room."""

    def __init__(self, buffer: TokenBuffer | None = None) -> None:
        self.buffer = buffer
        self.alloc = RingAllocator(buffer.capacity) if buffer is not None else None
        self.runs: dict[str, int] = {}  # request id -> offset of its prompt

    @classmethod
    def create(cls, ipc: IpcConfig) -> PromptRing:
        if not ipc.use_shm:
            return cls()
        return cls(TokenBuffer.create(ipc.prompt_shm_name, ipc.prompt_shm_tokens))

    def ref(self, request_id: str, ids: Sequence[int]) -> TokenRef:
        if self.alloc is not None and self.buffer is not None:
            offset = self.alloc.alloc(len(ids))
            if offset is not None:
                self.buffer.write(offset, ids)
                self.runs[request_id] = offset
                return TokenRef(offset=offset, length=len(ids))
        return TokenRef(ids=list(ids))

    def release(self, request_id: str) -> None:
        offset = self.runs.pop(request_id, None)
        if offset is not None and self.alloc is not None:
            self.alloc.free(offset)

    def release_later(self, request_id: str, delay: float) -> None:
        if request_id in self.runs:
            with contextlib.suppress(RuntimeError):  # no running loop: at shutdown
                asyncio.get_running_loop().call_later(delay, self.release, request_id)

    def close(self) -> None:
        """Unlink the buffer. Idempotent."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = self.alloc = None
