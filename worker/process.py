"""The worker process: receive plans, run them, and (rank 0) send back the sampled tokens.

The launcher starts one fresh process per tensor-parallel rank and calls
`run_worker(EngineConfig.from_json(text), rank)` in it; the return value is
the process exit code.

A step that fails fails only its requests: rank 0 answers with a StepResult
whose `failed` lists the plan's sequences, the runner forgets them, and the
worker serves on. That holds for a `PlanError` (found before any collective,
on every rank alike) at any tensor-parallel size, and for any other exception
with one rank; with several, another rank may be waiting in a collective, so
the state is unrecoverable and the worker says so (WorkerError) and exits.
A CUDA error other than running out of memory poisons the device: also fatal.

SIGTERM does not stop a worker by itself: it serves on until the scheduler's
Shutdown (the scheduler drains first), the scheduler's death, or
`shutdown_timeout + SIGTERM_GRACE_S`, so that a SIGTERM sent to every process at
once (systemd's way) still lets in-flight requests finish.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import traceback

import msgspec
import torch
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    Codec,
    FromWorker,
    GrammarPrepare,
    GrammarRelease,
    KvImport,
    KvImported,
    Plan,
    Shutdown,
    StepResult,
    TokenRef,
    ToWorker,
    WorkerError,
    WorkerReady,
)
from subway.ipc.peers import this_host
from subway.ipc.shm import TokenBuffer
from subway.ipc.sockets import Sockets
from subway.progress import Ticker
from subway.worker.families import resolve_device
from subway.worker.kv_remote import Fetches, KvServer, is_remote
from subway.worker.kv_share import Importer
from subway.worker.parallel import init_distributed
from subway.worker.runner import ModelRunner, PlanError, StepOutput

SAMPLED_SLOTS = 8  # rank 0 writes step N's ids to slot N % 8 of its sampled-token buffer
SIGTERM_GRACE_S = 15.0  # beyond shutdown_timeout, after SIGTERM, before exiting regardless
_POLL_MS = 100


class _Stop:
    """Set by SIGTERM / SIGINT; the loop checks it between plans."""

    def __init__(self) -> None:
        self.requested = False
        self.at = 0.0  # time.monotonic() of the first signal
        self.count = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the caller handles signals
                pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if not self.requested:
            self.at = time.monotonic()
        elif signum == signal.SIGTERM:
            return  # the launcher and systemd may both send one
        self.requested = True
        self.count += 1

    def expired(self, grace: float) -> bool:
        """A second SIGINT, or `grace` seconds since the first signal."""
        return self.requested and (self.count > 1 or time.monotonic() - self.at > grace)


def run_worker(config: EngineConfig, rank: int) -> int:
    """Serve plans until Shutdown or SIGTERM (0), or until a step fails (1, after a WorkerError)."""
    stop = _Stop()
    stop.install()
    if config.parallel.threads > 0:
        torch.set_num_threads(config.parallel.threads)
    loop = WorkerLoop(config, rank, stop)
    try:
        loop.start()
        return loop.run()
    except Exception as e:  # noqa: BLE001 - reported to the scheduler, then exit 1
        loop.report(e)
        return 1
    finally:
        loop.close()
        stop.restore()


class WorkerLoop:
    """One worker process: its sockets (from __init__), its runner and the rest (`start`),
    and the loop (`run`) that serves the scheduler's messages; `close` releases them all."""

    def __init__(self, config: EngineConfig, rank: int, stop: _Stop) -> None:
        self.config = config
        self.rank = rank
        self.world = config.parallel.tensor_parallel_size
        self.stop = stop
        self.codec_in = Codec(ToWorker, config.ipc.max_message_bytes)
        self.codec_out = Codec(FromWorker)
        self.ctx = zmq.Context()
        self.socks = Sockets(self.ctx, config.ipc)
        self.sub = self.socks.connect(zmq.SUB, config.ipc.plan_addr)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.push = self.socks.connect(zmq.PUSH, config.ipc.result_addr)
        self.poller = zmq.Poller()
        self.runner: ModelRunner | None = None
        self.sampled: TokenBuffer | None = None  # rank 0, with shared memory: sampled ids
        self.monitor: zmq.Socket | None = None
        self.kv_server: KvServer | None = None
        self.fetches: Fetches | None = None  # imports from other hosts
        self.importer = Importer(rank)
        self.rejected = 0  # malformed messages refused
        self.last_sent = 0.0  # time.perf_counter() of the last StepResult (or WorkerReady)

    def start(self) -> None:
        """The model (after the process group, with several ranks), then WorkerReady, then
        what the loop polls."""
        config, rank, world = self.config, self.rank, self.world
        if world > 1:
            init_distributed(
                world,
                rank,
                config.parallel.dist_init_addr,
                resolve_device(config.model.device, rank),
                config.parallel.collective_timeout,
            )
        what = f"worker {rank}: loading and preparing the weights of {config.model.path}"
        with Ticker(what):  # a line every 10 s past the first 5: big models take minutes
            runner = self.runner = ModelRunner(config, rank, world)
        # The model's many long-lived objects leave the collector's passes: in a batch-1 step
        # (`profile_step`, perf) a full pass over them took about 1.4% of the CPU time.
        gc.freeze()
        if rank == 0 and config.ipc.use_shm:
            self.sampled = TokenBuffer.create(
                config.ipc.sampled_shm_name, config.scheduler.max_num_seqs * SAMPLED_SLOTS
            )
        self.send(
            WorkerReady(
                rank=rank,
                pid=os.getpid(),
                num_blocks=runner.num_blocks,
                max_model_len=runner.max_model_len,
                vocab_size=runner.vocab_size,
                eos_token_ids=runner.eos_token_ids,
                sampled_shm=self.sampled.name if self.sampled is not None else None,
                host=this_host(),
                device=runner.device.type,
                kv_windows=runner.pages.reported_windows,
            )
        )
        self.last_sent = time.perf_counter()
        # The scheduler's death shows as a disconnect at once (the kernel closes its sockets).
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        if rank == 0:  # rank 0 compiles grammars, and answers when each is done
            self.poller.register(runner.grammars.wake_fd, zmq.POLLIN)
            # The compiler is built at the first grammar, on its compile thread (xgrammar's
            # import and the tokenizer's vocabulary: seconds of CPU, not counted against
            # --grammar-timeout): built here, at start, it took those seconds from the
            # first requests' steps (TTFT p50 +12%, throughput -5% in `compare`).
        self.fetches = Fetches(self.socks, self.poller, rank, world)
        if config.parallel.role == "prefill" and config.ipc.kv_addr:
            stride = max(1, config.parallel.data_parallel_size)
            addr = config.ipc.kv_rank_addr(rank, stride)
            self.kv_server = KvServer(self.socks, addr, runner.kv_caches)
            self.poller.register(self.kv_server.sock, zmq.POLLIN)

    def run(self) -> int:
        """Serve until Shutdown (0), the scheduler's disconnect (0 after a signal, else 1),
        or a signal's grace runs out (0)."""
        stop, poller, sub, monitor = self.stop, self.poller, self.sub, self.monitor
        grace = self.config.server.shutdown_timeout + SIGTERM_GRACE_S
        while not stop.expired(grace):
            events = dict(poller.poll(_POLL_MS))
            if monitor in events:
                monitor.recv_multipart()
                print(
                    f"subway worker {self.rank}: the scheduler disconnected; exiting",
                    file=sys.stderr,
                )
                return 0 if stop.requested else 1
            self._serve_events(events)
            if sub not in events:
                continue
            msg = self._receive()
            if isinstance(msg, Shutdown):
                return 0
            if isinstance(msg, Plan):
                self._step(msg)
            elif msg is not None:
                self._on_message(msg)
        return 0

    def send(self, msg: FromWorker) -> None:
        self.push.send(self.codec_out.encode(msg))

    def _serve_events(self, events: dict[object, int]) -> None:
        """The jobs besides plans: KV blocks asked of this prefill worker, remote KV imports'
        blocks (or time running out), grammar compiles done, failed or past their limit."""
        runner = self.runner
        if self.kv_server is not None and self.kv_server.sock in events:
            self.kv_server.serve()
        for answer in self.fetches.on_events(events, runner.kv_caches, time.perf_counter()):
            self.send(answer)
        grammars = runner.grammars
        if self.rank == 0 and (grammars.unanswered or grammars.wake_fd in events):
            for answer in grammars.answers():
                self.send(answer)

    def _receive(self) -> ToWorker | None:
        """The scheduler's next message, or None for a malformed one (counted, logged once)."""
        try:
            return self.codec_in.decode(self.sub.recv())
        except msgspec.DecodeError as e:
            self.rejected += 1
            if self.rejected == 1:  # once: a flood must not flood the log too
                print(f"subway worker {self.rank}: refused a malformed plan: {e}", file=sys.stderr)
            return None

    def _on_message(self, msg: GrammarPrepare | GrammarRelease | KvImport) -> None:
        """A message other than a plan or Shutdown."""
        runner = self.runner
        if isinstance(msg, GrammarPrepare):
            if self.rank == 0:
                runner.grammars.prepare_key(msg.key, msg.grammar)
        elif isinstance(msg, GrammarRelease):
            if self.rank == 0:
                runner.grammars.release(msg.keys)
        elif isinstance(msg, KvImport):  # every rank copies its shard, and says so
            if is_remote(msg.source):
                answer = self.fetches.start(runner.kv_caches, msg, time.perf_counter())
            else:
                answer = KvImported(
                    msg.import_id, self.rank, *self.importer.run(runner.kv_caches, msg)
                )
            if answer is not None:  # else when its blocks come (or its time runs out)
                self.send(answer)

    def _step(self, plan: Plan) -> None:
        """Run a plan; rank 0 sends its StepResult (`failed` set when the step failed)."""
        received = time.perf_counter()
        try:
            out = self.runner.execute(plan)
        except Exception as e:
            if not recoverable(e, self.world):
                raise
            traceback.print_exc()
            failed = self.runner.drop(plan)
            out = None
            error = f"{type(e).__name__}: {e}"
        done = time.perf_counter()
        if self.rank == 0:
            if out is None:
                result = StepResult(plan.step, [], TokenRef(ids=[]), failed=failed, error=error)
            else:
                result = _result(plan.step, out, self.sampled, self.config.scheduler.max_num_seqs)
            result.forward_time = done - received
            result.idle_time = received - self.last_sent
            result.rejected_total = self.rejected
            lora = self.runner.lora
            if lora is not None:
                result.lora_loads_total = lora.loads_total
                result.lora_evictions_total = lora.evictions_total
                result.lora_memory_bytes = lora.memory_bytes
            expert_tokens = getattr(self.runner.model, "expert_tokens", None)
            if expert_tokens is not None:
                result.moe_expert_tokens = expert_tokens.tolist()
            self.send(result)
            self.last_sent = time.perf_counter()

    def report(self, e: Exception) -> None:
        """A fatal error: its traceback to this process's log, a WorkerError to the scheduler."""
        traceback.print_exc()  # the whole story stays in this process's log
        message = f"{type(e).__name__}: {e}"
        try:
            self.push.send(
                self.codec_out.encode(WorkerError(rank=self.rank, message=message)), zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        if self.sampled is not None:
            self.sampled.close()
        if self.runner is not None:
            self.runner.close()
        # A short linger so that a final WorkerError still leaves the process.
        self.push.close(linger=1000)
        if self.fetches is not None:
            self.fetches.close()
        if self.kv_server is not None:
            self.kv_server.close()
        if self.monitor is not None:
            self.sub.disable_monitor()
            self.monitor.close(linger=0)
        self.sub.close()
        self.socks.close()
        self.ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def recoverable(e: Exception, world: int) -> bool:
    """Whether the worker can serve on after `e` failed a step (see the module docstring)."""
    if isinstance(e, PlanError):
        return True
    if world > 1:
        return False
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return "CUDA error" not in str(e) and "device-side assert" not in str(e)


def _result(
    step: int, out: StepOutput, sampled: TokenBuffer | None, max_num_seqs: int
) -> StepResult:
    """The StepResult of a plan; ids in the shared buffer when they fit their slot, else inline."""
    n = len(out.tokens)
    if sampled is None or n > max_num_seqs:
        return out.to_result(step)
    offset = (step % SAMPLED_SLOTS) * max_num_seqs
    sampled.write(offset, out.tokens)
    return out.to_result(step, TokenRef(offset=offset, length=n))
