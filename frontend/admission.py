"""What bounds one request's cost before the engine sees it.

- Fan-out: prompts x `n` of one request at most `--max-seqs-per-request`
  (`check_fan_out`, 400 naming `n` or `prompt`), and its prompt tokens times
  `n` at most `--max-queued-tokens` (`check_job_size`: such a request could never
  be admitted, so 400, not 429). The queue-wide bounds (sequences waiting,
  prompt tokens queued: 429 with Retry-After) are `EngineClient.check_capacity`'s.
- Preparation off the event loop: parsing a large body, rendering a chat
  template and tokenizing are plain CPU work that would freeze every other
  connection (and `/health`) while they run. `Offload.run` runs them on a few
  worker threads, each call under `--template-timeout` seconds. Past it the
  request gets 400 (what vLLM answers for a template that fails; the request's
  content made it slow), or 503 with Retry-After if it never got a thread
  (the server is busy). A call that overruns is stopped: an exception is raised
  in its thread (`PyThreadState_SetAsyncExc`), which ends a Jinja loop at its
  next bytecode; code inside a C call (a tokenizer's encode, bounded by the body
  size) finishes first. Its thread stays counted until it has stopped, so runaway
  templates cannot pile up more threads than `workers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from subway.frontend.errors import APIError
from subway.frontend.protocol import SamplingRequest
from subway.ipc.config import EngineConfig

T = TypeVar("T")
PREPARE_WORKERS = 4


def check_fan_out(req: SamplingRequest, config: EngineConfig) -> None:
    """Prompts x n of one request at most `max_seqs_per_request` (0: no bound)."""
    limit = config.server.max_seqs_per_request
    seqs = req.num_prompts * req.n
    if limit > 0 and seqs > limit:
        raise APIError(
            400,
            f"{req.num_prompts} prompt(s) x n={req.n} make {seqs} sequences; "
            f"this server takes at most {limit} per request",
            "n" if req.n > 1 else "prompt",
        )


def check_job_size(prompt_tokens: int, n: int, config: EngineConfig, param: str) -> None:
    """A request whose sequences alone hold more prompt tokens than the queue may: 400."""
    limit = config.server.max_queued_tokens
    tokens = prompt_tokens * n
    if limit > 0 and tokens > limit:
        raise APIError(
            400,
            f"the request's sequences hold {tokens} prompt tokens; this server queues at "
            f"most {limit}",
            param,
        )


class _Stop(BaseException):
    """Raised inside a worker thread whose call ran out of time (BaseException: the code
    it interrupts catches Exception)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Make `thread_id` raise `exc` at its next bytecode (None: cancel a pending one)."""
    arg = ctypes.py_object(exc) if exc is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), arg)


class _Call:
    """One call handed to a worker thread; `stop()` interrupts it if it still runs."""

    def __init__(self, fn: Callable[..., object], args: tuple, done: Callable[..., None]) -> None:
        self.fn, self.args, self.done = fn, args, done
        self.lock = threading.Lock()
        self.thread_id: int | None = None
        self.finished = False
        self.stopped = False

    def run(self) -> None:
        with self.lock:
            self.thread_id = threading.get_ident()
            skip = self.stopped  # given up on before a thread took it
        if skip:
            self.done(False, _Stop())
            return
        ok, value = False, None
        try:
            try:
                value, ok = self.fn(*self.args), True
            except BaseException as e:  # noqa: BLE001 -- the caller gets it, a _Stop included
                value = e
            finally:
                with self.lock:
                    self.finished = True
                    _raise_in(threading.get_ident(), None)  # a stop too late to matter
        except _Stop:  # it landed in the finally above: the call had ended anyway
            pass
        self.done(ok, value)

    def stop(self) -> None:
        with self.lock:
            if self.finished or self.stopped:
                return
            self.stopped = True
            if self.thread_id is not None:
                _raise_in(self.thread_id, _Stop)


class Offload:
    """A few worker threads for blocking request preparation, each call time-limited."""

    def __init__(self, timeout: float, workers: int = PREPARE_WORKERS) -> None:
        """`timeout`: seconds a call may take, its wait for a thread included (0: none)."""
        self.timeout = timeout
        self.workers = workers
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(
        self,
        fn: Callable[..., T],
        *args,
        what: str = "preparing the request",
        param: str | None = None,
    ) -> T:
        """`fn(*args)` on a worker thread; its exceptions are raised here. `what` and
        `param` name the work in the error of a call that overruns."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # one semaphore per event loop (tests run several)
            self._loop, self._slots = loop, asyncio.Semaphore(self.workers)
        slots = self._slots
        assert slots is not None
        deadline = loop.time() + self.timeout if self.timeout > 0 else None
        try:
            async with asyncio.timeout_at(deadline):
                await slots.acquire()
        except TimeoutError:
            raise APIError(
                503,
                f"the server is busy: no worker was free within {self.timeout:g} s",
                headers={"Retry-After": "1"},
            ) from None
        result: asyncio.Future = loop.create_future()

        def done(ok: bool, value: object) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(_settle, slots, result, ok, value)

        call = _Call(fn, args, done)
        self._start_threads()
        self._calls.put(call)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(result)
        except TimeoutError:
            raise APIError(
                400, f"{what} took longer than this server's limit of {self.timeout:g} s", param
            ) from None
        finally:
            if not result.done():
                call.stop()  # timed out or cancelled: the thread stops (its slot then frees)

    def _start_threads(self) -> None:
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._work, daemon=True, name="subway-prepare")
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            with contextlib.suppress(_Stop):  # a stop that missed its call entirely
                call.run()


def _settle(slots: asyncio.Semaphore, result: asyncio.Future, ok: bool, value: object) -> None:
    slots.release()
    if result.done():
        return
    if ok:
        result.set_result(value)
    elif isinstance(value, _Stop):
        result.cancel()
    else:
        result.set_exception(value)  # type: ignore[arg-type]
