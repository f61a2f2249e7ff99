"""The frontend's link to the scheduler: two sockets, and what they tell of the engine's health.

It pushes `ToScheduler` messages to `config.ipc.scheduler_addr` and binds a
PULL at `config.ipc.frontend_addr` for `ToFrontend` messages. Its state:
`info` (EngineReady), `error`, `stats` (the latest EngineStats) and the time
of the last message (every step's deltas, or the idle heartbeat). Token
deltas go to its `on_deltas`; a lost engine (an EngineError, the scheduler's
death, or `fail_after` seconds of silence) to its `on_lost`.

The scheduler is known by the pid and host of its EngineReady: a disconnect
on the bound socket (which any port probe causes) counts only if that process
has died. The link sends a FrontendHello at start, naming this frontend's
prompt buffer, and a FrontendAlive every `FRONTEND_HEARTBEAT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from subway.frontend.errors import APIError, public_reason
from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    FRONTEND_HEARTBEAT_S,
    Codec,
    Deltas,
    EngineError,
    EngineReady,
    EngineStats,
    FrontendAlive,
    FrontendHello,
    RequestDelta,
    ToFrontend,
    ToScheduler,
)
from subway.ipc.peers import RECHECK_S, process_alive, this_host
from subway.ipc.sockets import Sockets, cleanup_ipc, has_message

log = logging.getLogger("subway.frontend")


class EngineDeadError(RuntimeError):
    """The engine cannot serve this request: not ready, failed, silent, or shutting down."""


class SchedulerLink:
    """The two sockets to the scheduler, and what they tell of its health."""

    READ_BATCH = 64  # messages read in one turn of the event loop

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
        self.prompt_shm = ""  # this frontend's prompt buffer, named in its hello
        self.on_deltas = on_deltas
        self.on_lost = on_lost
        self.heartbeat_timeout = heartbeat_timeout
        self.fail_after = fail_after
        self.info: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.error: str | None = None
        self._last_seen = 0.0
        self.rejected = 0  # undecodable messages from the scheduler's side
        self._codec_out = Codec(ToScheduler)
        self._codec_in = Codec(ToFrontend, config.ipc.max_message_bytes)
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: Sockets | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.Socket | None = None  # a plain socket, read in `_on_readable`
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_new_scheduler: Callable[[], None] = lambda: None
        # The content digests of the engine's prefix cache, as its Deltas report them
        # (stored, removed, reset): the router's record of this engine (`router.py`).
        self.on_digests: Callable[[list[int], list[int], bool], None] | None = None
        self.engine_id = config.parallel.data_parallel_rank

    @property
    def num_rejected(self) -> int:
        """Messages refused here: undecodable ones, and CurveZMQ handshakes without our key."""
        socks = self._socks
        return self.rejected + (socks.denied if socks is not None else 0)

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
        socks = self._socks = Sockets(self._ctx, ipc)
        self._pull = socks.bind(zmq.PULL, ipc.frontend_addr, socket_class=zmq.Socket)
        self._push = socks.connect(zmq.PUSH, ipc.scheduler_addr, SNDHWM=0)
        self._hello()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._pull.getsockopt(zmq.FD), self._on_readable)
        self._loop.call_soon(self._on_readable)  # what came before the reader was added
        self._tasks = [
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
        if self._loop is not None and self._pull is not None and not self._pull.closed:
            self._loop.remove_reader(self._pull.getsockopt(zmq.FD))
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._pull is not None:
            cleanup_ipc(self.config.ipc.frontend_addr)
        self._push = self._pull = None
        if self._ctx is not None:
            self._socks.close()  # the ZAP handler's socket, before term
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------ messages

    def send(self, msg: msgspec.Struct) -> None:
        if self._push is None:
            raise EngineDeadError("the engine client is closed")
        data = self._codec_out.encode(msg)
        limit = self.config.ipc.max_message_bytes
        if len(data) > limit:  # the scheduler would refuse it: the request would never end
            raise APIError(
                400, f"the request is {len(data)} bytes as the engine sends it (at most {limit})"
            )
        fut = self._push.send(data, zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            raise EngineDeadError(f"cannot reach the scheduler: {fut.exception()}")

    def _hello(self) -> None:
        self.send(FrontendHello(pid=os.getpid(), host=this_host(), prompt_shm=self.prompt_shm))

    def _handle(self, msg) -> None:
        self._last_seen = time.monotonic()
        if isinstance(msg, Deltas):
            self.on_deltas(msg.deltas)
            if msg.stats is not None:
                self.stats = msg.stats
            if self.on_digests is not None and (
                msg.cache_stored or msg.cache_removed or msg.cache_reset
            ):
                self.on_digests(msg.cache_stored, msg.cache_removed, msg.cache_reset)
        elif isinstance(msg, EngineReady):
            if msg.engine_id != self.engine_id:
                # Another engine's scheduler at this engine's address: a misconfiguration
                # that would cross the two engines' requests. Refused, counted, never served.
                self.rejected += 1
                self.error = (
                    f"engine {msg.engine_id}'s scheduler answered at engine {self.engine_id}'s "
                    "address"
                )
                log.error("refused: %s", self.error)
                return
            if self.info is not None and (self.info.pid, self.info.host) != (msg.pid, msg.host):
                self.on_new_scheduler()
            self.info = msg
            self.error = None
            log.info("engine ready: %s", msg)
        elif isinstance(msg, EngineError):
            log.error("engine error: %s", msg.message)
            self.error = public_reason(msg.message)  # /health and error bodies show this
            self.on_lost(EngineDeadError(f"engine error: {self.error}"))

    def _on_readable(self) -> None:
        """Every message waiting on the PULL socket, read without blocking, up to
        `READ_BATCH` before the loop's other work (then it goes on at the loop's next turn).

        A plain socket read from the loop's own reader, not a zmq.asyncio one: pyzmq's
        asyncio socket spends a future, and a dozen enum operations on the socket's events,
        on every message, which made it the frontend's largest cost per streamed token. Its
        file descriptor signals edges, so each call reads until the socket has none left."""
        pull = self._pull
        for _ in range(self.READ_BATCH):
            if pull is None or pull.closed or not has_message(pull):
                return
            try:
                msg = self._codec_in.decode(pull.recv(zmq.NOBLOCK))
            except msgspec.DecodeError as e:
                self.rejected += 1
                if self.rejected == 1:  # once: a flood must not flood the log too
                    log.error("refused an undecodable message on the scheduler link: %s", e)
                continue
            try:
                self._handle(msg)
            except Exception:  # one message's failure must not leave the rest unread
                log.exception("handling a %s from the scheduler failed", type(msg).__name__)
        self._loop.call_soon(self._on_readable)

    async def _watch_connection(self) -> None:
        """Notice at once when the scheduler's connection drops (its process died, say).

        The kernel closes a dead process's sockets, so ZeroMQ reports the
        disconnect immediately: no heartbeat period to wait out. A scheduler
        that connects again is greeted, and answers with EngineReady.
        """
        assert self._pull is not None
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        monitor = self._pull.get_monitor_socket(events)
        checking: asyncio.Task | None = None
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                info = self.info
                if event == zmq.EVENT_DISCONNECTED and info is not None and self.error is None:
                    # Its pid may still read as alive while a killed process exits; a stray
                    # connection (a port probe) leaves it alive: then the heartbeat decides.
                    if checking is None or checking.done():
                        checking = asyncio.create_task(self._confirm_death(info))
                elif event == zmq.EVENT_ACCEPTED and self.error is not None:
                    self._hello()
        finally:
            if checking is not None:
                checking.cancel()
            if self._pull is not None:
                self._pull.disable_monitor()
            monitor.close(linger=0)

    async def _confirm_death(self, info: EngineReady) -> None:
        """After a disconnect: the engine is lost if the scheduler's pid dies within
        `RECHECK_S` (checked at once, then every 20 ms)."""
        deadline = time.monotonic() + RECHECK_S
        while self.error is None and self.info is info:
            if process_alive(info.pid, info.host) is False:
                self.error = "the scheduler died"
                log.error("engine error: %s (pid %d)", self.error, info.pid)
                self.on_lost(EngineDeadError(self.error))
                return
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.02)

    async def _watchdog(self) -> None:
        """Send the heartbeat; tell `on_lost` when a ready scheduler has been silent for
        `fail_after`."""
        tick = min(0.5, self.fail_after / 4, FRONTEND_HEARTBEAT_S)
        last_beat = 0.0
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_beat >= FRONTEND_HEARTBEAT_S:
                with contextlib.suppress(EngineDeadError):
                    self.send(FrontendAlive(pid=os.getpid(), host=this_host()))
                last_beat = now
            silent = now - self._last_seen
            if self.info is not None and silent > self.fail_after:
                self.on_lost(EngineDeadError(f"no word from the scheduler for {silent:.1f} s"))
