"""The frontend's engine client: requests out to the scheduler, each one's deltas back.

Three parts, one per concern:

- `SchedulerLink`: the sockets, and the engine's health. It pushes
  `ToScheduler` messages to `config.ipc.scheduler_addr` and binds a PULL at
  `config.ipc.frontend_addr` for `ToFrontend` messages. Its state: `info`
  (EngineReady), `error`, `stats` (the latest EngineStats) and the time of the
  last message (every step's deltas, or the idle heartbeat). Token deltas go to
  its `on_deltas`; a lost engine (an EngineError, the scheduler's connection
  dropping, or `fail_after` seconds of silence) to its `on_lost`;
- the prompt ring (`prompt_ring.py`). A run of an aborted request is freed
  only when a later delta for it arrives or after `abort_release_s`, because a
  plan that reads it may already be on its way to the workers;
- `RequestStream`: the deltas of one request. Its holder closes it; it tells
  whoever made it through the `on_close` callback it was given.

`EngineClient` puts them together: one per frontend process, used from its
event loop only. Sends use NOBLOCK and never await, so that an abort can be
sent from a `finally` block of a cancelled task; `submit` is synchronous for
the same reason, and so that admission (the `max_waiting` bound) is decided
before a response starts: a request either is in the scheduler's hands or raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from subway.frontend.errors import public_reason
from subway.frontend.prompt_ring import PromptRing
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
    ToScheduler,
)
from subway.ipc.sockets import Sockets, cleanup_ipc

log = logging.getLogger("subway.frontend")


class EngineDeadError(RuntimeError):
    """The engine cannot serve this request: not ready, failed, silent, or shutting down."""


class QueueFullError(RuntimeError):
    """More requests wait for the engine than `max_waiting` allows."""


class RequestStream:
    """The deltas of one submitted request, up to the one with a finish_reason.

    Iterate it with `async for`; `close()` (idempotent) ends it and calls
    `on_close(stream)`, whose owner aborts the request if it had not finished.
    Raises EngineDeadError when the engine fails.
    """

    def __init__(
        self, request_id: str, submitted_at: float, on_close: Callable[[RequestStream], None]
    ) -> None:
        self.request_id = request_id
        self.submitted_at = submitted_at
        self.finished = False
        self.closed = False
        self._on_close = on_close
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._queue.get()
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
            self._on_close(self)


class SchedulerLink:
    """The two sockets to the scheduler, and what they tell of its health."""

    def __init__(
        self,
        config: EngineConfig,
        on_deltas: Callable[[list[RequestDelta]], None],
        on_lost: Callable[[EngineDeadError], None],
        heartbeat_timeout: float = 3.0,
        fail_after: float = 30.0,
    ) -> None:
        """`heartbeat_timeout`: silence after which `healthy` turns false;
        `fail_after`: silence after which `on_lost` is told (every half second, while it lasts)."""
        self.config = config
        self.on_deltas = on_deltas
        self.on_lost = on_lost
        self.heartbeat_timeout = heartbeat_timeout
        self.fail_after = fail_after
        self.info: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.error: str | None = None
        self._last_seen = 0.0
        self._codec_out = Codec(ToScheduler)
        self._codec_in = Codec(ToFrontend)
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def ready(self) -> bool:
        """The scheduler said EngineReady and has not reported an error since."""
        return self.info is not None and self.error is None

    @property
    def healthy(self) -> bool:
        return self.ready and time.monotonic() - self._last_seen < self.heartbeat_timeout

    @property
    def is_open(self) -> bool:
        return self._push is not None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._pull is not None:
            return
        ipc = self.config.ipc
        self._ctx = zmq.asyncio.Context()
        socks = Sockets(self._ctx, ipc)
        self._pull = socks.bind(zmq.PULL, ipc.frontend_addr)
        self._push = socks.connect(zmq.PUSH, ipc.scheduler_addr, SNDHWM=0)
        self.send(FrontendHello(pid=os.getpid()))
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="subway-engine-reader"),
            asyncio.create_task(self._watchdog(), name="subway-engine-watchdog"),
            asyncio.create_task(self._watch_connection(), name="subway-engine-monitor"),
        ]

    async def stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._pull is not None:
            cleanup_ipc(self.config.ipc.frontend_addr)
        self._push = self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------ messages

    def send(self, msg: msgspec.Struct) -> None:
        if self._push is None:
            raise EngineDeadError("the engine client is closed")
        fut = self._push.send(self._codec_out.encode(msg), zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            raise EngineDeadError(f"cannot reach the scheduler: {fut.exception()}")

    def _handle(self, msg) -> None:
        self._last_seen = time.monotonic()
        if isinstance(msg, Deltas):
            self.on_deltas(msg.deltas)
            if msg.stats is not None:
                self.stats = msg.stats
        elif isinstance(msg, EngineReady):
            self.info = msg
            self.error = None
            log.info("engine ready: %s", msg)
        elif isinstance(msg, EngineError):
            log.error("engine error: %s", msg.message)
            self.error = public_reason(msg.message)  # /health and error bodies show this
            self.on_lost(EngineDeadError(f"engine error: {self.error}"))

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
                    self.on_lost(EngineDeadError(self.error))
                elif event == zmq.EVENT_ACCEPTED and self.error is not None:
                    self.send(FrontendHello(pid=os.getpid()))
        finally:
            if self._pull is not None:
                self._pull.disable_monitor()
            monitor.close(linger=0)

    async def _watchdog(self) -> None:
        """Tell `on_lost` when a ready scheduler has been silent for `fail_after`."""
        while True:
            await asyncio.sleep(min(0.5, self.fail_after / 4))
            silent = time.monotonic() - self._last_seen
            if self.info is not None and silent > self.fail_after:
                self.on_lost(EngineDeadError(f"no word from the scheduler for {silent:.1f} s"))


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        heartbeat_timeout: float = 3.0,
        fail_after: float = 30.0,
        abort_release_s: float = 10.0,
    ) -> None:
        """`heartbeat_timeout`: silence after which the link is not `healthy`;
        `fail_after`: silence after which in-flight requests fail."""
        self.config = config
        self.abort_release_s = abort_release_s
        self.draining = False  # set on SIGTERM: no new requests; in-flight ones finish
        self.link = SchedulerLink(
            config, self._route, self._fail_all, heartbeat_timeout, fail_after
        )
        self.ring = PromptRing()  # its shared memory is created by `start`
        self._streams: dict[str, RequestStream] = {}
        self._unstarted: set[str] = set()  # submitted, no delta yet: waiting (or prefilling)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a place in the batch, as far as this frontend can tell.

        Requests without a token yet, less the batch places (`max_num_seqs`) that
        requests with tokens leave free: a burst that the scheduler admits at once
        does not count as waiting. The scheduler's own count (preemptions, a batch
        limited by KV blocks) when it is larger.
        """
        unstarted = len(self._unstarted)
        started = len(self._streams) - unstarted
        free = max(0, self.config.scheduler.max_num_seqs - started)
        local = max(0, unstarted - free)
        stats = self.link.stats
        return max(local, stats.num_waiting if stats is not None else 0)

    def check_capacity(self, n: int, max_waiting: int | None = None) -> None:
        """Raise QueueFullError if `n` more requests would exceed `max_waiting` (0: no bound)."""
        limit = self.config.server.max_waiting if max_waiting is None else max_waiting
        if limit > 0 and self.num_waiting + n > limit:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (at most {limit})")

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.link.is_open:
            return
        self.ring = PromptRing.create(self.config.ipc)
        self.link.start()

    async def aclose(self) -> None:
        await self.link.stop_tasks()
        self.close()

    def close(self) -> None:
        """Fail what is in flight, close the sockets, unlink the shm. Idempotent."""
        self._fail_all(EngineDeadError("the frontend is shutting down"))
        self.link.close()
        self.ring.close()

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
        if not self.link.ready or not self.link.is_open:
            raise EngineDeadError(self.link.error or "the engine is not ready")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        submitted_at = time.time()
        try:
            self.link.send(
                AddRequest(
                    request_id=request_id,
                    prompt=self.ring.ref(request_id, prompt_ids),
                    prompt_len=len(prompt_ids),
                    sampling=sampling,
                    arrival_time=submitted_at,
                    priority=priority,
                    slo_ttft_ms=slo_ttft_ms,
                    slo_class=slo_class,
                )
            )
        except BaseException:
            self.ring.release(request_id)
            raise
        stream = RequestStream(request_id, submitted_at, self._stream_closed)
        self._streams[request_id] = stream
        self._unstarted.add(request_id)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        **options,
    ) -> AsyncIterator[RequestDelta]:
        """`submit` (same `options`) as an async generator: leaving it early (close, cancel,
        exception in the consumer) aborts the request; use `contextlib.aclosing` so that this
        happens at once."""
        stream = self.submit(request_id, prompt_ids, sampling, **options)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort_all(self) -> int:
        """Abort every request in flight: the scheduler drops them, and each stream ends
        at once with finish_reason "abort" (at shutdown, when the drain has timed out)."""
        live = list(self._streams.values())
        for stream in live:
            self._send_abort(stream.request_id)
            stream.put(
                RequestDelta(request_id=stream.request_id, token_ids=[], finish_reason="abort")
            )
        return len(live)

    # ------------------------------------------------------------ callbacks

    def _stream_closed(self, stream: RequestStream) -> None:
        """A stream ended: forget it; abort the request in the scheduler if unfinished."""
        request_id = stream.request_id
        self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)
        if stream.finished:
            self.ring.release(request_id)
        else:
            self._send_abort(request_id)
            self.ring.release_later(request_id, self.abort_release_s)

    def _send_abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # a closed link: nothing left to abort
            self.link.send(AbortRequest(request_id=request_id))

    def _route(self, deltas: list[RequestDelta]) -> None:
        """The link's deltas, each to its request's stream (and its prompt's run freed)."""
        for delta in deltas:
            self.ring.release(delta.request_id)
            self._unstarted.discard(delta.request_id)
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put(delta)

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put(error)
