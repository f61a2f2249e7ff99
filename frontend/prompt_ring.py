"""The frontend's prompt ring: prompt ids in shared memory, written once, read in place.

This frontend owns the buffer (creates and unlinks it). Its name is the run's
prompt-buffer name plus a suffix of this process's own, so that a restarted
frontend never meets its predecessor's segment; the FrontendHello names it,
and the scheduler passes the name on to the workers in their next plan. They
attach to it and read a prompt's run where it lies, so an AddRequest carries
only its offset and length. A run is freed at its request's first delta: by
then the workers have read it. Ids go inline when the ring is full, or without
shared memory (`--no-shm`, several hosts).

The ring's pages are committed when it is made (`TokenBuffer.create`): a /dev/shm
without room for it is a `ShmSpaceError` when the frontend starts, never a SIGBUS
on some later prompt's write.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from subway.ipc.config import IpcConfig
from subway.ipc.messages import TokenRef
from subway.ipc.shm import RingAllocator, TokenBuffer


class PromptRing:
    """Prompt ids in shared memory, one run per request; inline ids without a buffer or room."""

    def __init__(self, buffer: TokenBuffer | None = None) -> None:
        self.buffer = buffer
        self.name = buffer.name if buffer is not None else ""
        self.alloc = RingAllocator(buffer.capacity) if buffer is not None else None
        self.runs: dict[str, int] = {}  # request id -> offset of its prompt

    @classmethod
    def create(cls, ipc: IpcConfig) -> PromptRing:
        if not ipc.use_shm:
            return cls()
        name = f"{ipc.prompt_shm_name}_{uuid.uuid4().hex[:8]}"
        hint = "or lower --prompt-shm-tokens, or run with --no-shm"
        return cls(TokenBuffer.create(name, ipc.prompt_shm_tokens, hint=hint))

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

    def close(self) -> None:
        """Unlink the buffer. Idempotent."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = self.alloc = None
