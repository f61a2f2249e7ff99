"""The worker process: receive plans, run them, and (rank 0) send back the sampled tokens.

The launcher starts one fresh process per tensor-parallel rank and calls
`run_worker(EngineConfig.from_json(text), rank)` in it; the return value is
the process exit code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    Codec,
    FromWorker,
    Plan,
    Shutdown,
    StepResult,
    TokenRef,
    ToWorker,
    WorkerError,
    WorkerReady,
)
from subway.ipc.shm import TokenBuffer
from subway.ipc.sockets import Sockets
from subway.worker.parallel import init_distributed
from subway.worker.runner import ModelRunner, StepOutput, resolve_device

SAMPLED_SLOTS = 8  # rank 0 writes step N's ids to slot N % 8 of its sampled-token buffer
_POLL_MS = 100


class _Stop:
    """Set by SIGTERM / SIGINT; the loop checks it between plans."""

    def __init__(self) -> None:
        self.requested = False
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
        self.requested = True


def run_worker(config: EngineConfig, rank: int) -> int:
    """Serve plans until Shutdown or SIGTERM (0), or until a step fails (1, after a WorkerError)."""
    stop = _Stop()
    stop.install()
    if config.parallel.threads > 0:
        torch.set_num_threads(config.parallel.threads)
    codec_in, codec_out = Codec(ToWorker), Codec(FromWorker)
    ctx = zmq.Context()
    socks = Sockets(ctx, config.ipc)
    sub = socks.connect(zmq.SUB, config.ipc.plan_addr)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    push = socks.connect(zmq.PUSH, config.ipc.result_addr)
    runner: ModelRunner | None = None
    sampled: TokenBuffer | None = None
    monitor: zmq.Socket | None = None
    try:
        world = config.parallel.tensor_parallel_size
        if world > 1:
            init_distributed(
                world,
                rank,
                config.parallel.dist_init_addr,
                resolve_device(config.model.device, rank),
            )
        runner = ModelRunner(config, rank, world)
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
                )
            )
        )
        last_sent = time.perf_counter()
        # The scheduler's death shows as a disconnect at once (the kernel closes its sockets).
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not stop.requested:
            events = dict(poller.poll(_POLL_MS))
            if monitor in events:
                monitor.recv_multipart()
                print(f"subway worker {rank}: the scheduler disconnected; exiting", file=sys.stderr)
                return 1
            if sub not in events:
                continue
            msg = codec_in.decode(sub.recv())
            if isinstance(msg, Shutdown):
                return 0
            assert isinstance(msg, Plan)
            received = time.perf_counter()
            out = runner.execute(msg)
            done = time.perf_counter()
            if rank == 0:
                result = _result(msg.step, out, sampled, config.scheduler.max_num_seqs)
                result.forward_time = done - received
                result.idle_time = received - last_sent
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
        if monitor is not None:
            sub.disable_monitor()
            monitor.close(linger=0)
        sub.close()
        ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        stop.restore()


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
