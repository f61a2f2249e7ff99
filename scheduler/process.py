"""The scheduler process: sockets around an `EngineCore`, one loop, no threads.

Sockets (all but the last bound here; the workers' two are in `worker_link.py`):

    PULL  config.ipc.scheduler_addr  <- frontends  (ToScheduler)
    XPUB  config.ipc.plan_addr       -> workers    (ToWorker)
    PULL  config.ipc.result_addr     <- workers    (FromWorker)
    PUSH  config.ipc.frontend_addr   -> frontend   (ToFrontend; connected)

Each turn of the loop drains every socket without blocking (the workers' first,
then the frontends'), runs one engine-core step (settle the results that came,
plan while fewer than 2 (overlap) or 1 plans are in flight), sends the deltas
it has, then blocks in poll. Requests that come before the workers are ready
wait, and are applied when the engine starts.

The frontend's requests are aborted when it is gone (died, or silent: the
`FrontendWatch` in `liveness.py`); SIGTERM drains (`Drain`, there too). Every
message is checked (`checks.py`) before use; what fails is refused and counted
in `ipc_rejected_total`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AbortRequest,
    AddLora,
    AddRequest,
    Codec,
    Deltas,
    EngineError,
    EngineReady,
    FrontendAlive,
    FrontendHello,
    ReleaseKv,
    RemoveLora,
    RequestDelta,
    ToFrontend,
    ToScheduler,
    WorkerReady,
)
from subway.ipc.peers import Refusals, this_host
from subway.ipc.shm import TokenBuffer, resolve
from subway.ipc.sockets import Sockets, cleanup_ipc, has_message
from subway.scheduler.checks import check_add, ids_in_vocab
from subway.scheduler.engine_core import EngineCore
from subway.scheduler.handoff import Imports, Leases
from subway.scheduler.liveness import Drain, FrontendWatch
from subway.scheduler.policy import make_policy
from subway.scheduler.scheduler import Scheduler
from subway.scheduler.worker_link import LINGER_MS, WorkerLink

log = logging.getLogger("subway.scheduler")

HEARTBEAT_S = 0.5  # a Deltas with stats at least this often once ready
LOG_INTERVAL_S = 5.0  # one stats line in the log at most this often, while there is activity
POLL_MAX_MS = 100  # longest block in poll, so that a signal is seen soon
# What one more wake of this loop a step costs a CPU worker's step (its threads take every
# core, so the loop's CPU comes out of theirs): late planning's price (`engine_core.py`).
CPU_WAKE_COST_S = 0.0003


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
        self.ctx = zmq.Context()
        socks = self.socks = Sockets(self.ctx, config.ipc)
        self.workers = WorkerLink(socks, config)
        self.requests = socks.bind(zmq.PULL, config.ipc.scheduler_addr, RCVHWM=0)
        self.frontend = socks.connect(zmq.PUSH, config.ipc.frontend_addr, SNDHWM=0)
        # A frontend that dies leaves requests nobody will read: abort them when it goes.
        self.frontend_monitor = self.requests.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.in_codec = Codec(ToScheduler, config.ipc.max_message_bytes)
        self.out_codec = Codec(ToFrontend)
        self.sched: Scheduler | None = None
        self.core: EngineCore | None = None
        self.ready_msg: EngineReady | None = None
        self.early: list[
            AddRequest | AbortRequest | AddLora | RemoveLora
        ] = []  # requests that came before ready
        self.prompt_buf: TokenBuffer | None = None
        self.prompt_shm = config.ipc.prompt_shm_name  # as the frontend's hello names it
        self.out: list[RequestDelta] = []  # deltas to send at the end of this turn
        self.last_out_at = 0.0
        self.last_log_at = time.monotonic()
        self.watch = FrontendWatch()
        self.refusals = Refusals(log, "a frontend")
        self.drain = Drain(config.server.shutdown_timeout)
        self.exit_code: int | None = None
        self.digests_reset = False  # owe the frontend a full report of the cached digests
        self.imports: Imports | None = None  # a decode engine's KV copies in

    def request_stop(self, signum: int = 0, frame: object = None) -> None:
        """The signal handler: see `Drain.request`."""
        self.drain.request(signum)

    def _drained(self) -> bool:
        """After SIGTERM: nothing left to do, and no frontend that may still send."""
        sched = self.sched
        busy = bool(self.out) or (
            sched is not None and (sched.has_work or sched.has_pending_deltas)
        )
        return self.drain.done(busy, self.watch)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        poller = zmq.Poller()
        for sock in (self.workers.plans, self.workers.results, self.requests):
            poller.register(sock, zmq.POLLIN)
        poller.register(self.frontend_monitor, zmq.POLLIN)
        try:
            while not self.drain.stop_now and self.exit_code is None and not self._drained():
                self._drain()
                if self.exit_code is not None:
                    break
                timeout = POLL_MAX_MS
                if self.core is not None:
                    self._handoffs()
                    self._grammars()
                    self.out += self.core.step()
                    self._flush()
                    self._maybe_log()
                    wait = self.last_out_at + HEARTBEAT_S - time.monotonic()
                    due = self.core.wake_in()  # late planning: the next plan's time
                    if due is not None and due < wait:
                        wait = due
                    timeout = max(0, min(POLL_MAX_MS, int(wait * 1000) + 1))
                poller.poll(timeout)
        except Exception as e:
            log.exception("scheduler failed")
            self._send_frontend(EngineError(f"scheduler failed: {e!r}"))
            return 1
        return 0 if self.exit_code is None else self.exit_code

    def _handoffs(self) -> None:
        """Disaggregation's turn: leases that expired; KV copies answered or overdue."""
        now = time.monotonic()
        sched = self.sched
        if sched.leases is not None and sched.leases.held:
            sched.leases.expire(now)
        if self.imports is not None:
            for answer in self.workers.collect_imports():
                self.imports.on_answer(answer)
            if self.imports.pending:
                self.imports.expire(now)

    def _grammars(self) -> None:
        """Grammars' turn: rank 0's compile answers, overdue ones, and what the workers need
        to hear (a grammar to compile, grammars to forget) before the next plan."""
        sched = self.sched
        assert sched is not None
        for answer in self.workers.collect_grammars():
            sched.on_grammar(answer)
        sched.expire_grammars()
        for msg in sched.grammars.take_outbox():  # type: ignore[union-attr]
            self.workers.send_import(msg)

    def _drain(self) -> None:
        workers = self.workers
        workers.drain()
        if workers.failure is not None:
            log.error("the engine cannot serve: %s", workers.failure)
            self._send_frontend(EngineError(workers.failure))
            self.exit_code = 1
            return
        if self.core is None:
            ranks = workers.ready_ranks()
            if ranks is not None:
                self._start(ranks)
        while has_message(self.requests):
            self._on_request(self.requests.recv(zmq.NOBLOCK))
        disconnected = False
        while has_message(self.frontend_monitor):
            self.frontend_monitor.recv_multipart(zmq.NOBLOCK)
            disconnected = True
        why = self.watch.check(disconnected)
        if why is not None:
            self._on_frontend_gone(why)

    def _on_frontend_gone(self, why: str) -> None:
        """Nobody will read the frontend's requests: abort them, forget the frontend."""
        live = self.sched.request_ids() if self.sched is not None else []
        log.warning("%s; aborting its %d requests", why, len(live))
        for rid in live:
            self.sched.abort(rid)  # type: ignore[union-attr]
        if self.imports is not None:  # and those still waiting for their KV copies
            for rid in self.imports.requests():
                self.imports.abort(rid)
        self.early = []
        self.watch.forget()

    def _flush(self) -> None:
        """Send this turn's deltas with stats, or a heartbeat when it is time."""
        deltas = self.out
        if deltas or time.monotonic() - self.last_out_at >= HEARTBEAT_S:
            self.out = []
            sched = self.sched
            assert sched is not None
            rejected = self.refusals.count + self.workers.num_rejected + self.socks.denied
            sched.stats.ipc_rejected_total = rejected
            msg = Deltas(deltas, sched.engine_stats())
            s = msg.stats
            s.lora_loads_total, s.lora_evictions_total, s.lora_memory_bytes = (
                self.workers.lora_counts
            )
            s.moe_expert_tokens_total = self.workers.moe_expert_tokens
            blocks = sched.block_manager
            if blocks.track_digests:
                msg.cache_stored, msg.cache_removed = blocks.take_digest_events()
                if self.digests_reset:
                    msg.cache_stored, msg.cache_reset = blocks.cached_digests(), True
                    self.digests_reset = False
            self._send_frontend(msg)

    def _maybe_log(self) -> None:
        """One line of engine statistics every LOG_INTERVAL_S, while anything happens."""
        now = time.monotonic()
        if now - self.last_log_at < LOG_INTERVAL_S:
            return
        sched = self.sched
        assert sched is not None
        stats = sched.stats
        if stats.num_steps_planned == stats.logged_steps and not sched.has_work:
            self.last_log_at = now
            return
        log.info("%s", stats.log_line(sched.engine_stats(), now - self.last_log_at))
        self.last_log_at = now

    def _send_frontend(self, msg: msgspec.Struct) -> None:
        try:
            self.frontend.send(self.out_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("frontend not reachable: dropped a %s", type(msg).__name__)
        self.last_out_at = time.monotonic()

    # ------------------------------------------------------------ messages

    def _on_request(self, data: bytes) -> None:
        try:
            msg = self.in_codec.decode(data)
        except msgspec.DecodeError as e:
            self.refusals.refuse("undecodable", str(e))
            return
        if isinstance(msg, FrontendHello):
            self._on_hello(msg)
            return
        if isinstance(msg, FrontendAlive):
            self.watch.heartbeat(msg.pid, msg.host)
            return
        self.watch.heard()
        if self.sched is None:
            self.early.append(msg)
        else:
            self._apply(msg)

    def _on_hello(self, msg: FrontendHello) -> None:
        """A frontend (re)starts: it is now the one; its prompt buffer replaces the last."""
        old = self.watch.replaced_by(msg.pid, msg.host)
        if old is not None:
            self._on_frontend_gone(f"a new frontend (pid {msg.pid}) replaced pid {old}")
        self.watch.hello(msg.pid, msg.host)
        name = msg.prompt_shm or self.config.ipc.prompt_shm_name
        if name != self.prompt_shm or self.prompt_buf is not None:
            if self.prompt_buf is not None:
                self.prompt_buf.close()
                self.prompt_buf = None
            self.prompt_shm = name
            self.workers.use_prompts(name)
        if self.ready_msg is not None:
            self._send_frontend(self.ready_msg)
        self.digests_reset = True  # the next Deltas carries every cached digest
        self.last_out_at = 0.0  # and goes at once

    def _apply(self, msg: AddRequest | AbortRequest | ReleaseKv | AddLora | RemoveLora) -> None:
        sched = self.sched
        assert sched is not None
        if isinstance(msg, ReleaseKv):
            if sched.leases is None or not sched.leases.release(msg.lease_id):
                log.info("release of lease %d: not held (expired, or never ours)", msg.lease_id)
            return
        if isinstance(msg, AbortRequest):
            if self.imports is None or not self.imports.abort(msg.request_id):
                sched.abort(msg.request_id)
            return
        if isinstance(msg, AddLora):
            if not sched.loras.add(msg.adapter):
                self.refusals.refuse("bad adapter", f"id {msg.adapter.lora_id} (LoRA off or taken)")
            return
        if isinstance(msg, RemoveLora):
            sched.loras.remove(msg.lora_id)
            return
        vocab = self.ready_msg.vocab_size if self.ready_msg is not None else 0
        problem = check_add(msg, vocab)
        ids = self._read_prompt(msg) if problem is None else None
        if problem is None and ids is not None and not ids_in_vocab(ids, vocab):
            problem = f"a prompt token id outside [0, {vocab})"
        if problem is not None:
            self.refusals.refuse("bad request", f"{msg.request_id[:64]!r}: {problem}")
            ids = None
        if msg.kv_source is not None and self.imports is not None and ids is not None:
            self.imports.add(msg, ids)  # queued once its blocks are copied in (or not)
            return
        sched.add(msg, ids if ids is not None else [])  # no ids: it finishes with "error"

    def _read_prompt(self, req: AddRequest) -> list[int] | None:
        ref = req.prompt
        if ref.ids is not None:
            return list(ref.ids)
        if self.prompt_buf is None:
            try:
                self.prompt_buf = TokenBuffer.attach(self.prompt_shm)
            except (OSError, ValueError) as e:
                log.error("cannot attach the prompt buffer: %s", e)
                return None
        try:
            return resolve(ref, self.prompt_buf)  # a copy: the frontend reuses the space
        except ValueError as e:
            self.refusals.refuse("bad prompt ref", f"{req.request_id[:64]!r}: {e}")
            return None

    def _start(self, ranks: list[WorkerReady]) -> None:
        """Every worker is ready: make the scheduler and the engine core, greet the frontend."""
        config = self.config
        rank0 = ranks[0]
        num_blocks = min(w.num_blocks for w in ranks)
        max_len = min(w.max_model_len for w in ranks)
        if config.model.max_model_len > 0:
            max_len = min(max_len, config.model.max_model_len)
        if any(w.kv_windows != rank0.kv_windows for w in ranks):
            raise RuntimeError(f"the workers' KV groups differ: {[w.kv_windows for w in ranks]}")
        self.workers.start(rank0)
        sched = self.sched = Scheduler(
            config, num_blocks, max_len, rank0.eos_token_ids, grammars_by_key=True,
            kv_windows=tuple(rank0.kv_windows) or (0,),
        )  # fmt: skip
        self.workers.step_cost = sched.step_cost  # the hung-step bound follows the cost model
        role = config.parallel.role
        if role == "prefill":
            sched.leases = Leases(sched, config.kv_source)
        world = config.parallel.tensor_parallel_size
        self.imports = Imports(sched, self.workers.send_import, world) if role == "decode" else None
        sc = config.scheduler
        self.core = EngineCore(
            sched,
            self.workers,
            2 if sc.overlap else 1,
            late_planning=sc.late_planning,
            wake_cost_s=CPU_WAKE_COST_S if rank0.device == "cpu" else 0.0,
        )
        self.ready_msg = EngineReady(
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            max_model_len=sched.max_model_len,
            vocab_size=rank0.vocab_size,
            eos_token_ids=list(rank0.eos_token_ids),
            pid=os.getpid(),
            host=this_host(),
            engine_id=config.parallel.data_parallel_rank,
        )
        log.info("engine ready: %s", self.ready_msg)
        self._send_frontend(self.ready_msg)
        early, self.early = self.early, []
        for msg in early:
            self._apply(msg)

    # ------------------------------------------------------------ exit

    def close(self) -> None:
        """Tell the workers to exit, close everything, remove the socket files."""
        self.workers.close()
        if self.sched is not None and self.sched.leases is not None:
            self.sched.leases.close()  # the lease table (`ipc/kv_leases.py`)
        self.requests.disable_monitor()
        self.frontend_monitor.close(linger=0)
        self.frontend.close(linger=LINGER_MS)
        self.requests.close(linger=0)
        self.socks.close()  # the ZAP handler's socket, before term
        self.ctx.term()
        cleanup_ipc(self.config.ipc.scheduler_addr)
        if self.prompt_buf is not None:
            self.prompt_buf.close()
            self.prompt_buf = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the Subway scheduler process")
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run_scheduler(EngineConfig.from_json_arg(args.config_json))


if __name__ == "__main__":
    sys.exit(main())
