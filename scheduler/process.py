"""The scheduler process: sockets around a `Scheduler`, one loop, no threads.

Sockets (all but the last bound here):

    PULL  config.ipc.scheduler_addr  <- frontends  (ToScheduler)
    XPUB  config.ipc.plan_addr       -> workers    (ToWorker; XPUB so that subscriptions are seen)
    PULL  config.ipc.result_addr     <- workers    (FromWorker)
    PUSH  config.ipc.frontend_addr   -> frontend   (ToFrontend; connected)

No plan goes out before `tensor_parallel_size` subscriptions and as many
WorkerReady messages have arrived: a PUB socket drops what it sends before a
subscriber has joined. Each turn of the loop drains every socket without
blocking (results first), plans while fewer than 2 (overlap) or 1 plans are in
flight, sends the deltas it has, then blocks in poll.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections import deque

import msgspec
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AbortRequest,
    AddRequest,
    Codec,
    Deltas,
    EngineError,
    EngineReady,
    FromWorker,
    FrontendHello,
    RequestDelta,
    Shutdown,
    StepResult,
    ToFrontend,
    ToScheduler,
    ToWorker,
    WorkerError,
    WorkerReady,
)
from subway.ipc.shm import TokenBuffer, resolve
from subway.ipc.sockets import bind, cleanup_ipc, connect
from subway.scheduler.policy import make_policy
from subway.scheduler.scheduler import Scheduler

log = logging.getLogger("subway.scheduler")

HEARTBEAT_S = 0.5  # a Deltas with stats at least this often once ready
LOG_INTERVAL_S = 5.0  # one stats line in the log at most this often, while there is activity
POLL_MAX_MS = 100  # longest block in poll, so that a signal is seen soon
LINGER_MS = 1000  # time left to deliver Shutdown / EngineError on close


def run_scheduler(config: EngineConfig) -> int:
    """The scheduler process main; returns the exit code (0 on SIGTERM/SIGINT, 1 on error)."""
    make_policy(config.scheduler.policy)  # fail before binding anything
    loop = SchedulerLoop(config)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, loop.request_stop)
    try:
        return loop.run()
    finally:
        loop.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class SchedulerLoop:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.max_inflight = 2 if config.scheduler.overlap else 1
        self.ctx = zmq.Context()
        self.requests = bind(self.ctx, zmq.PULL, config.ipc.scheduler_addr, RCVHWM=0)
        self.plans = bind(
            self.ctx, zmq.XPUB, config.ipc.plan_addr, XPUB_VERBOSE=1, XPUB_VERBOSER=1, SNDHWM=0
        )  # verbose-r: every (un)subscription, so each worker's arrival and departure show
        self.results = bind(self.ctx, zmq.PULL, config.ipc.result_addr, RCVHWM=0)
        self.frontend = connect(self.ctx, zmq.PUSH, config.ipc.frontend_addr, SNDHWM=0)
        # A frontend that dies leaves requests nobody will read: abort them when it goes.
        self.frontend_monitor = self.requests.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.in_codec = Codec(ToScheduler)
        self.worker_codec = Codec(FromWorker)
        self.plan_codec = Codec(ToWorker)
        self.out_codec = Codec(ToFrontend)
        self.sched: Scheduler | None = None
        self.ready_msg: EngineReady | None = None
        self.num_subscribers = 0
        self.workers: dict[int, WorkerReady] = {}
        self.early: list[AddRequest | AbortRequest] = []  # requests that came before ready
        self.prompt_buf: TokenBuffer | None = None
        self.sampled_buf: TokenBuffer | None = None
        self.out: list[RequestDelta] = []  # deltas to send at the end of this turn
        self.sent_at: deque[float] = deque()  # perf_counter() when each in-flight plan left
        self.last_result_at = 0.0
        self.last_out_at = 0.0
        self.last_log_at = time.monotonic()
        self.last_log_step = 0
        self.sched_time_acc = 0.0  # schedule() seconds since the last log line
        self.stop = False
        self.exit_code: int | None = None

    def request_stop(self, signum: int = 0, frame: object = None) -> None:
        self.stop = True

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        poller = zmq.Poller()
        for sock in (self.plans, self.results, self.requests, self.frontend_monitor):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self.stop and self.exit_code is None:
                self._drain()
                if self.exit_code is not None:
                    break
                timeout = POLL_MAX_MS
                if self.sched is not None:
                    self._plan()
                    self._flush()
                    self._maybe_log()
                    wait = self.last_out_at + HEARTBEAT_S - time.monotonic()
                    timeout = max(0, min(POLL_MAX_MS, int(wait * 1000) + 1))
                poller.poll(timeout)
        except Exception as e:
            log.exception("scheduler failed")
            self._send_frontend(EngineError(f"scheduler failed: {e!r}"))
            return 1
        return 0 if self.exit_code is None else self.exit_code

    def _drain(self) -> None:
        for sock, handle in (
            (self.plans, self._on_subscription),
            (self.results, self._on_worker),
            (self.requests, self._on_request),
        ):
            while self.exit_code is None:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handle(data)
        while True:
            try:
                self.frontend_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_frontend_gone()

    def _on_frontend_gone(self) -> None:
        live = self.sched.request_ids() if self.sched is not None else []
        log.warning("a frontend disconnected; aborting its %d requests", len(live))
        for rid in live:
            self.sched.abort(rid)  # type: ignore[union-attr]

    def _plan(self) -> None:
        sched = self.sched
        assert sched is not None
        while sched.num_inflight_plans < self.max_inflight:
            plan = sched.schedule()
            if plan is None:
                return
            self.plans.send(self.plan_codec.encode(plan))
            self.sent_at.append(time.perf_counter())
            self.sched_time_acc += sched.last_schedule_time

    def _flush(self) -> None:
        """Send this turn's deltas with stats, or a heartbeat when it is time."""
        sched = self.sched
        assert sched is not None
        deltas = self.out
        if sched.has_pending_deltas:
            deltas.extend(sched.pop_pending_deltas())
        if deltas or time.monotonic() - self.last_out_at >= HEARTBEAT_S:
            self.out = []
            self._send_frontend(Deltas(deltas, sched.stats()))

    def _maybe_log(self) -> None:
        """One line of engine statistics every LOG_INTERVAL_S, while anything happens."""
        now = time.monotonic()
        if now - self.last_log_at < LOG_INTERVAL_S:
            return
        sched = self.sched
        assert sched is not None
        steps = sched.num_steps - self.last_log_step
        if steps == 0 and not sched.has_work:
            self.last_log_at = now
            return
        log.info("%s", format_stats(sched, steps, now - self.last_log_at, self.sched_time_acc))
        self.last_log_at = now
        self.last_log_step = sched.num_steps
        self.sched_time_acc = 0.0

    def _send_frontend(self, msg: msgspec.Struct) -> None:
        try:
            self.frontend.send(self.out_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("frontend not reachable: dropped a %s", type(msg).__name__)
        self.last_out_at = time.monotonic()

    # ------------------------------------------------------------ messages

    def _on_subscription(self, data: bytes) -> None:
        if data[:1] == b"\x01":
            self.num_subscribers += 1
            self._maybe_ready()
        elif data[:1] == b"\x00":
            self.num_subscribers -= 1
            if self.sched is not None and self.exit_code is None:
                # A worker's SUB pipe closed: the process died (the kernel closed its sockets).
                log.error("a worker disconnected; the engine cannot serve")
                self._send_frontend(EngineError("a worker disconnected (process died?)"))
                self.exit_code = 1

    def _on_worker(self, data: bytes) -> None:
        try:
            msg = self.worker_codec.decode(data)
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            log.error("undecodable message from a worker: %s", e)
            return
        if isinstance(msg, StepResult):
            self._on_result(msg)
        elif isinstance(msg, WorkerReady):
            if self.sched is not None:
                log.warning("WorkerReady from rank %d after the engine was ready", msg.rank)
                return
            self.workers[msg.rank] = msg
            self._maybe_ready()
        elif isinstance(msg, WorkerError):
            log.error("worker %d failed: %s", msg.rank, msg.message)
            self._send_frontend(EngineError(f"worker {msg.rank}: {msg.message}"))
            self.exit_code = 1

    def _on_result(self, msg: StepResult) -> None:
        sched = self.sched
        if sched is None:
            log.warning("step result before the engine was ready")
            return
        if msg.tokens.ids is None and self.sampled_buf is None:
            raise RuntimeError("sampled ids are in shared memory, but rank 0 named no buffer")
        tokens = resolve(msg.tokens, self.sampled_buf)
        now = time.perf_counter()
        sent = self.sent_at.popleft() if self.sent_at else now
        sched.last_step_time = now - max(sent, self.last_result_at)
        self.last_result_at = now
        self.out.extend(sched.process_result(msg, tokens))

    def _on_request(self, data: bytes) -> None:
        try:
            msg = self.in_codec.decode(data)
        except msgspec.DecodeError as e:
            log.error("undecodable message from a frontend: %s", e)
            return
        if isinstance(msg, FrontendHello):
            if self.prompt_buf is not None:  # a new frontend has a new buffer of the same name
                self.prompt_buf.close()
                self.prompt_buf = None
            if self.ready_msg is not None:
                self._send_frontend(self.ready_msg)
            return
        if self.sched is None:
            self.early.append(msg)
        else:
            self._apply(msg)

    def _apply(self, msg: AddRequest | AbortRequest) -> None:
        sched = self.sched
        assert sched is not None
        if isinstance(msg, AbortRequest):
            sched.abort(msg.request_id)
            return
        ids = self._read_prompt(msg)
        sched.add(msg, ids if ids is not None else [])  # no ids: it finishes with "error"

    def _read_prompt(self, req: AddRequest) -> list[int] | None:
        ref = req.prompt
        if ref.ids is not None:
            return list(ref.ids)
        if self.prompt_buf is None:
            try:
                self.prompt_buf = TokenBuffer.attach(self.config.ipc.prompt_shm_name)
            except (OSError, ValueError) as e:
                log.error("cannot attach the prompt buffer: %s", e)
                return None
        ids = resolve(ref, self.prompt_buf)  # a copy: the frontend reuses the space
        if len(ids) != ref.length or ref.offset < 0:
            log.error("request %s: prompt run out of the buffer's bounds", req.request_id)
            return None
        return ids

    def _maybe_ready(self) -> None:
        tp = self.config.parallel.tensor_parallel_size
        if self.sched is not None or self.num_subscribers < tp:
            return
        if any(rank not in self.workers for rank in range(tp)):
            return
        ranks = [self.workers[r] for r in range(tp)]
        rank0 = ranks[0]
        num_blocks = min(w.num_blocks for w in ranks)
        max_len = min(w.max_model_len for w in ranks)
        if self.config.model.max_model_len > 0:
            max_len = min(max_len, self.config.model.max_model_len)
        if rank0.sampled_shm:
            try:
                self.sampled_buf = TokenBuffer.attach(rank0.sampled_shm)
            except (OSError, ValueError) as e:
                log.error("cannot attach rank 0's sampled-token buffer: %s", e)
        sched = self.sched = Scheduler(self.config, num_blocks, max_len, rank0.eos_token_ids)
        self.ready_msg = EngineReady(
            num_blocks=num_blocks,
            block_size=self.config.cache.block_size,
            max_model_len=sched.max_model_len,
            vocab_size=rank0.vocab_size,
            eos_token_ids=list(rank0.eos_token_ids),
        )
        log.info("engine ready: %s", self.ready_msg)
        self._send_frontend(self.ready_msg)
        early, self.early = self.early, []
        for msg in early:
            self._apply(msg)

    # ------------------------------------------------------------ exit

    def close(self) -> None:
        """Tell the workers to exit, close everything, remove the socket files."""
        try:
            self.plans.send(self.plan_codec.encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not publish Shutdown: %s", e)
        self.requests.disable_monitor()
        self.frontend_monitor.close(linger=0)
        for sock in (self.plans, self.frontend):
            sock.close(linger=LINGER_MS)
        for sock in (self.requests, self.results):
            sock.close(linger=0)
        self.ctx.term()
        cleanup_ipc(self.config.ipc.scheduler_addr, self.config.ipc.plan_addr, self.config.ipc.result_addr)
        for buf in (self.prompt_buf, self.sampled_buf):
            if buf is not None:
                buf.close()
        self.prompt_buf = self.sampled_buf = None


def format_stats(sched: Scheduler, steps: int, interval: float, sched_time: float) -> str:
    """The periodic log line: queues, the last step, KV blocks, prefix cache, step rate."""
    s = sched.stats()
    queries = s.prefix_cache_queries_total
    hit = f"{100.0 * s.prefix_cache_hits_total / queries:.1f}%" if queries else "-"
    per_step = f"{1e6 * sched_time / steps:.0f}us" if steps else "-"
    return (
        f"running {s.num_running} waiting {s.num_waiting} "
        f"(preempted {sched.num_preempted_waiting}, {s.num_preempted_total} total) | "
        f"last step: {s.batch_size} seqs {s.num_batched_tokens} tokens | "
        f"KV blocks used {s.kv_blocks_used} cached {s.kv_blocks_cached} "
        f"free {s.kv_blocks_free}/{s.kv_blocks_total} | prefix hit {hit} | "
        f"{steps / interval:.1f} steps/s, schedule {per_step}/step"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the Subway scheduler process")
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run_scheduler(EngineConfig.from_json(args.config_json))


if __name__ == "__main__":
    sys.exit(main())
