"""The frontend's bridge to the scheduler: requests out, token deltas back, over ZeroMQ.

One `EngineClient` per frontend process, used from its event loop only. It
pushes `ToScheduler` messages to `config.ipc.scheduler_addr` and binds a PULL at
`config.ipc.frontend_addr` for `ToFrontend` messages, which a background task
routes to per-request queues.

Prompt ids go through a shared-memory `TokenBuffer` that this client owns
(creates and unlinks). A prompt's run is freed when its first delta arrives:
by then the workers have read it. A run of an aborted request is freed only
when a later delta for it arrives or after `abort_release_s`, because a plan
that reads it may already be on its way to the workers.

Sends use NOBLOCK and never await, so that an abort can be sent from a
`finally` block of a cancelled task. `submit` is synchronous for the same
reason, and so that admission (the `max_waiting` bound) is decided before a
response starts: a request either is in the scheduler's hands or raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AbortRequest,
    AddRequest,
    Codec,
    Deltas,
    EngineError,
    EngineReady,
    EngineStats,
    FrontendHello,
    RequestDelta,
    SamplingParams,
    ToFrontend,
    TokenRef,
    ToScheduler,
)
from subway.ipc.shm import RingAllocator, TokenBuffer
from subway.ipc.sockets import bind, cleanup_ipc, connect

log = logging.getLogger("subway.frontend")


class EngineDeadError(RuntimeError):
    """The engine cannot serve this request: not ready, failed, silent, or shutting down."""


class QueueFullError(RuntimeError):
    """More requests wait for the engine than `max_waiting` allows."""


class RequestStream:
    """The deltas of one submitted request, up to the one with a finish_reason.

    Iterate it with `async for`; `close()` (idempotent) ends it, sending an
    AbortRequest if the request had not finished. Raises EngineDeadError when
    the engine fails or the request is aborted from outside.
    """

    def __init__(self, client: EngineClient, request_id: str, queue: asyncio.Queue) -> None:
        self.client = client
        self.request_id = request_id
        self.queue = queue
        self.finished = False
        self.closed = False
        self.submitted_at = time.time()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finish_reason is not None:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client._done(self.request_id, self.finished)


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        heartbeat_timeout: float = 3.0,
        fail_after: float = 30.0,
        abort_release_s: float = 10.0,
    ) -> None:
        """`heartbeat_timeout`: silence after which `healthy` turns false;
        `fail_after`: silence after which in-flight requests fail."""
        self.config = config
        self.heartbeat_timeout = heartbeat_timeout
        self.fail_after = fail_after
        self.abort_release_s = abort_release_s
        self.info: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.error: str | None = None
        self._last_seen = 0.0
        self.draining = False  # set on SIGTERM: no new requests; in-flight ones finish
        self._queues: dict[str, asyncio.Queue] = {}
        self._unstarted: set[str] = set()  # submitted, no delta yet: waiting (or prefilling)
        self._runs: dict[str, int] = {}  # request id -> offset of its prompt in shm
        self._codec_out = Codec(ToScheduler)
        self._codec_in = Codec(ToFrontend)
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._buffer: TokenBuffer | None = None
        self._alloc: RingAllocator | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        """The scheduler said EngineReady and has not reported an error since."""
        return self.info is not None and self.error is None

    @property
    def healthy(self) -> bool:
        return self.ready and time.monotonic() - self._last_seen < self.heartbeat_timeout

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a place in the batch, as far as this frontend can tell.

        Requests without a token yet, less the batch places (`max_num_seqs`) that
        requests with tokens leave free: a burst that the scheduler admits at once
        does not count as waiting. The scheduler's own count (preemptions, a batch
        limited by KV blocks) when it is larger.
        """
        unstarted = len(self._unstarted)
        started = len(self._queues) - unstarted
        free = max(0, self.config.scheduler.max_num_seqs - started)
        local = max(0, unstarted - free)
        engine = self.stats.num_waiting if self.stats is not None else 0
        return max(local, engine)

    def check_capacity(self, n: int, max_waiting: int | None = None) -> None:
        """Raise QueueFullError if `n` more requests would exceed `max_waiting` (0: no bound)."""
        limit = self.config.server.max_waiting if max_waiting is None else max_waiting
        if limit > 0 and self.num_waiting + n > limit:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (at most {limit})")

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._pull is not None:
            return
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        self._pull = bind(self._ctx, zmq.PULL, cfg.ipc.frontend_addr)
        self._push = connect(self._ctx, zmq.PUSH, cfg.ipc.scheduler_addr, SNDHWM=0)
        if cfg.ipc.use_shm:
            self._buffer = TokenBuffer.create(cfg.ipc.prompt_shm_name, cfg.ipc.prompt_shm_tokens)
            self._alloc = RingAllocator(self._buffer.capacity)
        self._send(FrontendHello(pid=os.getpid()))
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="subway-engine-reader"),
            asyncio.create_task(self._watchdog(), name="subway-engine-watchdog"),
            asyncio.create_task(self._watch_connection(), name="subway-engine-monitor"),
        ]

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()

    def close(self) -> None:
        """Fail what is in flight, close the sockets, unlink the shm. Idempotent."""
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        self._fail_all(EngineDeadError("the frontend is shutting down"))
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._pull is not None:
            cleanup_ipc(self.config.ipc.frontend_addr)
        self._push = self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = self._alloc = None

    # ------------------------------------------------------------ requests

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_class: str = "interactive",
    ) -> RequestStream:
        """Send one request to the scheduler now; its deltas come through the returned stream.

        Raises EngineDeadError if the engine cannot serve. Whoever holds the
        stream must close it (it aborts the request if unfinished).
        """
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if not self.ready or self._push is None:
            raise EngineDeadError(self.error or "the engine is not ready")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._unstarted.add(request_id)
        stream = RequestStream(self, request_id, queue)
        try:
            self._send(
                AddRequest(
                    request_id=request_id,
                    prompt=self._prompt_ref(request_id, prompt_ids),
                    prompt_len=len(prompt_ids),
                    sampling=sampling,
                    arrival_time=stream.submitted_at,
                    priority=priority,
                    slo_ttft_ms=slo_ttft_ms,
                    slo_class=slo_class,
                )
            )
        except BaseException:
            self._queues.pop(request_id, None)
            self._unstarted.discard(request_id)
            self._release(request_id)
            stream.closed = True
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_class: str = "interactive",
    ) -> AsyncIterator[RequestDelta]:
        """`submit` as an async generator: leaving it early (close, cancel, exception in
        the consumer) aborts the request; use `contextlib.aclosing` so that this happens at once."""
        stream = self.submit(
            request_id,
            prompt_ids,
            sampling,
            priority=priority,
            slo_ttft_ms=slo_ttft_ms,
            slo_class=slo_class,
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def _done(self, request_id: str, finished: bool) -> None:
        """A stream ended: forget its queue; abort the request in the scheduler if unfinished."""
        self._queues.pop(request_id, None)
        self._unstarted.discard(request_id)
        if finished:
            self._release(request_id)
        else:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequest(request_id=request_id))
            self._release_later(request_id)

    def abort_all(self) -> int:
        """Abort every request in flight: the scheduler drops them, and each stream ends
        at once with finish_reason "abort" (at shutdown, when the drain has timed out)."""
        live = list(self._queues)
        for request_id in live:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequest(request_id=request_id))
            self._queues[request_id].put_nowait(
                RequestDelta(request_id=request_id, token_ids=[], finish_reason="abort")
            )
        return len(live)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream (it then ends with an EngineDeadError)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(EngineDeadError("aborted"))

    # ------------------------------------------------------------ internals

    def _send(self, msg: msgspec.Struct) -> None:
        if self._push is None:
            raise EngineDeadError("the engine client is closed")
        fut = self._push.send(self._codec_out.encode(msg), zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            raise EngineDeadError(f"cannot reach the scheduler: {fut.exception()}")

    def _prompt_ref(self, request_id: str, ids: Sequence[int]) -> TokenRef:
        if self._alloc is not None and self._buffer is not None:
            offset = self._alloc.alloc(len(ids))
            if offset is not None:
                self._buffer.write(offset, ids)
                self._runs[request_id] = offset
                return TokenRef(offset=offset, length=len(ids))
        return TokenRef(ids=list(ids))

    def _release(self, request_id: str) -> None:
        offset = self._runs.pop(request_id, None)
        if offset is not None and self._alloc is not None:
            self._alloc.free(offset)

    def _release_later(self, request_id: str) -> None:
        if request_id in self._runs:
            with contextlib.suppress(RuntimeError):  # no running loop: at shutdown
                asyncio.get_running_loop().call_later(
                    self.abort_release_s, self._release, request_id
                )

    def _fail_all(self, error: Exception) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _handle(self, msg) -> None:
        self._last_seen = time.monotonic()
        if isinstance(msg, Deltas):
            for delta in msg.deltas:
                self._release(delta.request_id)
                self._unstarted.discard(delta.request_id)
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            if msg.stats is not None:
                self.stats = msg.stats
        elif isinstance(msg, EngineReady):
            self.info = msg
            self.error = None
            log.info("engine ready: %s", msg)
        elif isinstance(msg, EngineError):
            self.error = msg.message or "engine error"
            log.error("engine error: %s", self.error)
            self._fail_all(EngineDeadError(f"engine error: {self.error}"))

    async def _read_loop(self) -> None:
        assert self._pull is not None
        while True:
            data = await self._pull.recv()
            try:
                msg = self._codec_in.decode(data)
            except msgspec.DecodeError as e:
                log.error("undecodable message from the scheduler: %s", e)
                continue
            self._handle(msg)

    async def _watch_connection(self) -> None:
        """Notice at once when the scheduler's connection drops (its process died, say).

        The kernel closes a dead process's sockets, so ZeroMQ reports the
        disconnect immediately: no heartbeat period to wait out. A scheduler
        that connects again is greeted, and answers with EngineReady.
        """
        assert self._pull is not None
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        monitor = self._pull.get_monitor_socket(events)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED and self.info is not None:
                    self.error = "the scheduler disconnected"
                    log.error("engine error: %s", self.error)
                    self._fail_all(EngineDeadError(self.error))
                elif event == zmq.EVENT_ACCEPTED and self.error is not None:
                    self._send(FrontendHello(pid=os.getpid()))
        finally:
            if self._pull is not None:
                self._pull.disable_monitor()
            monitor.close(linger=0)

    async def _watchdog(self) -> None:
        """Fail in-flight requests when a ready scheduler has been silent for `fail_after`."""
        while True:
            await asyncio.sleep(min(0.5, self.fail_after / 4))
            silent = time.monotonic() - self._last_seen
            if self.info is not None and self._queues and silent > self.fail_after:
                self._fail_all(EngineDeadError(f"no word from the scheduler for {silent:.1f} s"))
