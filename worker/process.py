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
from subway.worker.kv_remote import Fetches, KvServer, is_remote
from subway.worker.kv_share import Importer
from subway.worker.parallel import init_distributed
from subway.worker.runner import ModelRunner, PlanError, StepOutput, resolve_device

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

    def _handle(self, signum, frame) -> None:
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
    codec_in, codec_out = Codec(ToWorker, config.ipc.max_message_bytes), Codec(FromWorker)
    ctx = zmq.Context()
    socks = Sockets(ctx, config.ipc)
    sub = socks.connect(zmq.SUB, config.ipc.plan_addr)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    push = socks.connect(zmq.PUSH, config.ipc.result_addr)
    runner: ModelRunner | None = None
    sampled: TokenBuffer | None = None
    monitor: zmq.Socket | None = None
    kv_server: KvServer | None = None
    fetches: Fetches | None = None
    try:
        world = config.parallel.tensor_parallel_size
        if world > 1:
            init_distributed(
                world,
                rank,
                config.parallel.dist_init_addr,
                resolve_device(config.model.device, rank),
                config.parallel.collective_timeout,
            )
        runner = ModelRunner(config, rank, world)
        # The model's many long-lived objects leave the collector's passes: in a batch-1 step
        # (`profile_step`, perf) a full pass over them took about 1.4% of the CPU time.
        gc.freeze()
        if rank == 0 and config.ipc.use_shm:
            sampled = TokenBuffer.create(
                config.ipc.sampled_shm_name, config.scheduler.max_num_seqs * SAMPLED_SLOTS
            )
        push.send(
            codec_out.encode(
                WorkerReady(
                    rank=rank,
                    pid=os.getpid(),
                    num_blocks=runner.num_blocks,
                    max_model_len=runner.max_model_len,
                    vocab_size=runner.vocab_size,
                    eos_token_ids=runner.eos_token_ids,
                    sampled_shm=sampled.name if sampled is not None else None,
                    host=this_host(),
                    device=runner.device.type,
                )
            )
        )
        importer = Importer(rank)
        last_sent = time.perf_counter()
        # The scheduler's death shows as a disconnect at once (the kernel closes its sockets).
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        grammars = runner.grammars  # rank 0 compiles, and answers when each is done
        if rank == 0:
            poller.register(grammars.wake_fd, zmq.POLLIN)
            # The compiler is built at the first grammar, on its compile thread (xgrammar's
            # import and the tokenizer's vocabulary: seconds of CPU, not counted against
            # --grammar-timeout): built here, at start, it took those seconds from the
            # first requests' steps (TTFT p50 +12%, throughput -5% in `compare`).
        fetches = Fetches(socks, poller, rank, world)  # imports from other hosts
        if config.parallel.role == "prefill" and config.ipc.kv_addr:
            stride = max(1, config.parallel.data_parallel_size)
            kv_server = KvServer(socks, config.ipc.kv_rank_addr(rank, stride), runner.kv_caches)
            poller.register(kv_server.sock, zmq.POLLIN)
        grace = config.server.shutdown_timeout + SIGTERM_GRACE_S
        rejected = 0
        while not stop.expired(grace):
            events = dict(poller.poll(_POLL_MS))
            if monitor in events:
                monitor.recv_multipart()
                print(f"subway worker {rank}: the scheduler disconnected; exiting", file=sys.stderr)
                return 0 if stop.requested else 1
            if kv_server is not None and kv_server.sock in events:
                kv_server.serve()
            for answer in fetches.on_events(events, runner.kv_caches, time.perf_counter()):
                push.send(codec_out.encode(answer))
            if rank == 0 and (
                grammars.unanswered or grammars.wake_fd in events
            ):  # compiles done, failed or past their limit
                for answer in grammars.answers():
                    push.send(codec_out.encode(answer))
            if sub not in events:
                continue
            try:
                msg = codec_in.decode(sub.recv())
            except msgspec.DecodeError as e:
                rejected += 1
                if rejected == 1:  # once: a flood must not flood the log too
                    print(f"subway worker {rank}: refused a malformed plan: {e}", file=sys.stderr)
                continue
            if isinstance(msg, Shutdown):
                return 0
            if isinstance(msg, GrammarPrepare):
                if rank == 0:
                    grammars.prepare_key(msg.key, msg.grammar)
                continue
            if isinstance(msg, GrammarRelease):
                if rank == 0:
                    grammars.release(msg.keys)
                continue
            if isinstance(msg, KvImport):  # every rank copies its shard, and says so
                if is_remote(msg.source):
                    answer = fetches.start(runner.kv_caches, msg, time.perf_counter())
                else:
                    answer = KvImported(msg.import_id, rank, *importer.run(runner.kv_caches, msg))
                if answer is not None:  # else when its blocks come (or its time runs out)
                    push.send(codec_out.encode(answer))
                continue
            received = time.perf_counter()
            try:
                out = runner.execute(msg)
            except Exception as e:
                if not recoverable(e, world):
                    raise
                traceback.print_exc()
                failed = runner.drop(msg)
                out = None
                error = f"{type(e).__name__}: {e}"
            done = time.perf_counter()
            if rank == 0:
                if out is None:
                    result = StepResult(msg.step, [], TokenRef(ids=[]), failed=failed, error=error)
                else:
                    result = _result(msg.step, out, sampled, config.scheduler.max_num_seqs)
                result.forward_time = done - received
                result.idle_time = received - last_sent
                result.rejected_total = rejected
                push.send(codec_out.encode(result))
                last_sent = time.perf_counter()
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the scheduler, then exit 1
        traceback.print_exc()  # the whole story stays in this process's log
        message = f"{type(e).__name__}: {e}"
        try:
            push.send(codec_out.encode(WorkerError(rank=rank, message=message)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return 1
    finally:
        if sampled is not None:
            sampled.close()
        if runner is not None:
            runner.close()
        # A short linger so that a final WorkerError still leaves the process.
        push.close(linger=1000)
        if fetches is not None:
            fetches.close()
        if kv_server is not None:
            kv_server.close()
        if monitor is not None:
            sub.disable_monitor()
            monitor.close(linger=0)
        sub.close()
        socks.close()
        ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        stop.restore()


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
