"""The scheduler's link to its workers: plans out, results in. The `EngineCore` executor of
the worker processes.

    XPUB  config.ipc.plan_addr    -> workers  (ToWorker; XPUB so that subscriptions are seen)
    PULL  config.ipc.result_addr  <- workers  (FromWorker)

No plan goes out before `tensor_parallel_size` subscriptions and as many
WorkerReady messages have arrived: a PUB socket drops what it sends before a
subscriber has joined. A worker's SUB pipe that closes once the engine runs
means its process died (the kernel closed its sockets): that, or a
WorkerError, is a `failure`, and the engine cannot serve.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    Codec,
    FromWorker,
    Plan,
    Shutdown,
    StepResult,
    ToWorker,
    WorkerError,
    WorkerReady,
)
from subway.ipc.shm import TokenBuffer, resolve
from subway.ipc.sockets import Sockets, cleanup_ipc

log = logging.getLogger("subway.scheduler")

LINGER_MS = 1000  # time left to deliver Shutdown on close


class WorkerLink:
    def __init__(self, socks: Sockets, config: EngineConfig) -> None:
        self.config = config
        self.plans = socks.bind(
            zmq.XPUB, config.ipc.plan_addr, XPUB_VERBOSE=1, XPUB_VERBOSER=1, SNDHWM=0
        )  # verbose-r: every (un)subscription, so each worker's arrival and departure show
        self.results = socks.bind(zmq.PULL, config.ipc.result_addr, RCVHWM=0)
        self._in = Codec(FromWorker)
        self._out = Codec(ToWorker)
        self.num_subscribers = 0
        self.workers: dict[int, WorkerReady] = {}
        self.started = False  # the engine runs: plans may go out
        self.failure: str | None = None
        self.sampled_buf: TokenBuffer | None = None
        self._results: list[tuple[StepResult, list[int]]] = []

    def ready_ranks(self) -> list[WorkerReady] | None:
        """Every rank's WorkerReady once all have subscribed and said so, in rank order."""
        tp = self.config.parallel.tensor_parallel_size
        if self.started or self.num_subscribers < tp:
            return None
        if any(rank not in self.workers for rank in range(tp)):
            return None
        return [self.workers[r] for r in range(tp)]

    def start(self, rank0: WorkerReady) -> None:
        """The engine runs from now on; sampled ids are read from rank 0's buffer."""
        if rank0.sampled_shm:
            try:
                self.sampled_buf = TokenBuffer.attach(rank0.sampled_shm)
            except (OSError, ValueError) as e:
                log.error("cannot attach rank 0's sampled-token buffer: %s", e)
        self.started = True

    # ------------------------------------------------------------ the executor

    def submit(self, plan: Plan) -> None:
        self.plans.send(self._out.encode(plan))

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        out, self._results = self._results, []
        return out

    # ------------------------------------------------------------ receiving

    def drain(self) -> None:
        """Read every subscription change and worker message there is, without blocking."""
        for sock, handle in ((self.plans, self._on_subscription), (self.results, self._on_msg)):
            while self.failure is None:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handle(data)

    def _on_subscription(self, data: bytes) -> None:
        if data[:1] == b"\x01":
            self.num_subscribers += 1
        elif data[:1] == b"\x00":
            self.num_subscribers -= 1
            if self.started:
                self.failure = "a worker disconnected (process died?)"

    def _on_msg(self, data: bytes) -> None:
        try:
            msg = self._in.decode(data)
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            log.error("undecodable message from a worker: %s", e)
            return
        if isinstance(msg, StepResult):
            if not self.started:
                log.warning("step result before the engine was ready")
                return
            if msg.tokens.ids is None and self.sampled_buf is None:
                raise RuntimeError("sampled ids are in shared memory, but rank 0 named no buffer")
            self._results.append((msg, resolve(msg.tokens, self.sampled_buf)))
        elif isinstance(msg, WorkerReady):
            if self.started:
                log.warning("WorkerReady from rank %d after the engine was ready", msg.rank)
                return
            self.workers[msg.rank] = msg
        elif isinstance(msg, WorkerError):
            self.failure = f"worker {msg.rank}: {msg.message}"

    # ------------------------------------------------------------ exit

    def close(self) -> None:
        """Tell the workers to exit; close the sockets and the sampled-token buffer."""
        try:
            self.plans.send(self._out.encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not publish Shutdown: %s", e)
        self.plans.close(linger=LINGER_MS)
        self.results.close(linger=0)
        cleanup_ipc(self.config.ipc.plan_addr, self.config.ipc.result_addr)
        if self.sampled_buf is not None:
            self.sampled_buf.close()
            self.sampled_buf = None
