"""The frontend's grammar compiles, in child processes that a time limit can kill.

A grammar is a program for xgrammar's compiler, and some compile for minutes
(many patterns with bounded repeats, large alternations). A compile runs in C++
code that no thread can interrupt, so it runs here, in a process:

- a host (`python -m subway.frontend.grammar_host FD`, `grammar_host.py`), started on first use,
  imports xgrammar (and with it torch: the frontend itself imports neither),
  loads the tokenizer and builds xgrammar's tokenizer info once; then it forks
  workers on request, so that a new worker costs a fork, not an import;
- `workers` worker processes, each compiling one grammar at a time, without a
  cache of its own, with one thread and at a lower CPU priority (`NICE`), so
  that compiles take spare cycles and the engine keeps its own;
- `GrammarPool` (in the frontend's event loop) hands a grammar to an idle
  worker and awaits its verdict. Past the deadline the worker is killed and a
  new one forked in its place: a timed-out compile holds no CPU and no slot.

Nothing crosses as pickle: frames are a 4-byte length and msgspec's msgpack
(the grammar, its verdict), the control socket's messages are msgpack too, and
a worker's socket is handed to the host with SCM_RIGHTS. The host dies with the
frontend and the workers with the host (PR_SET_PDEATHSIG); a worker whose
private memory passes `WORKER_MAX_PRIVATE` after a compile exits and is
replaced, and its address space is capped (`WORKER_MAX_MEMORY` more than it
started with), so a grammar whose compile would take all memory fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys
import weakref
from collections import deque
from dataclasses import dataclass

import msgspec

from subway.ipc.messages import MAX_GRAMMAR_CHARS

NICE = 10  # the workers' niceness: under CFS a busy nice-0 process gets ~10x their share
START_TIMEOUT = 120.0  # seconds the host may take to import xgrammar and read the tokenizer
CTRL_MAX = 1 << 16  # bytes of one control message
MAX_FRAME = 4 * MAX_GRAMMAR_CHARS + 4096  # a grammar of MAX_GRAMMAR_CHARS, as UTF-8 msgpack
MAX_REPLY = 1 << 14  # bytes of a verdict (its message is at most MAX_ERROR_CHARS)
WORKER_MAX_PRIVATE = 1 << 29  # bytes of private memory a worker may keep after a compile
WORKER_MAX_MEMORY = 4 << 30  # bytes of address space a worker may add while compiling
HEADER = struct.Struct("!I")
PR_SET_PDEATHSIG = 1


class PoolError(Exception):
    """The pool cannot check grammars now (its host is gone or would not start)."""


class PoolStartError(PoolError):
    """The host could not build xgrammar's tokenizer info: no structured outputs here."""


class PoolBusy(Exception):
    """No worker was free before the deadline."""


class CompileTimeout(Exception):
    """The compile did not end before the deadline (its worker was killed)."""


class WorkerDied(Exception):
    """The worker ended during the compile (out of memory, or a crash in xgrammar)."""


# ---------------------------------------------------------------- messages


class HostInit(msgspec.Struct, array_like=True):
    tokenizer: str  # what AutoTokenizer.from_pretrained loads
    vocab_size: int
    eos_token_ids: list[int]
    frontend_pid: int


class HostReady(msgspec.Struct, array_like=True):
    error: str = ""  # why the tokenizer info could not be built ("": ready)


class Fork(msgspec.Struct, tag="fork", array_like=True):
    """Fork a worker on the socket that comes with this message (SCM_RIGHTS)."""


class Kill(msgspec.Struct, tag="kill", array_like=True):
    pid: int


class Forked(msgspec.Struct, array_like=True):
    pid: int


class Verdict(msgspec.Struct, array_like=True):
    error: str | None = None  # xgrammar's message, cleaned; None: it compiled


encode = msgspec.msgpack.encode


# ---------------------------------------------------------------- the frontend's side


@dataclass
class _Worker:
    pid: int
    sock: socket.socket


class GrammarPool:
    """Grammar compiles in `workers` killable processes (see the module's docstring).

    Used from one event loop (`loop`); `start` before `compile`; `close` (idempotent)
    stops the host and its workers, as does the pool's garbage collection."""

    def __init__(
        self, tokenizer: str, vocab_size: int, eos_token_ids: list[int], workers: int = 2
    ) -> None:
        self.init = HostInit(tokenizer, vocab_size, list(eos_token_ids), os.getpid())
        self.workers = max(1, workers)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.broken = ""  # why the pool cannot serve ("": it can)
        self._proc: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None
        self._ctrl_lock = asyncio.Lock()
        self._idle: deque[_Worker] = deque()
        self._waiters: deque[asyncio.Future] = deque()
        self._refills: set[asyncio.Task] = set()
        self._open: dict[int, socket.socket] = {}  # every worker's socket, by pid
        self._finalizer = weakref.finalize(self, _shutdown, self._open, [None, None])

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the host and fork the workers; PoolStartError if xgrammar cannot read the
        tokenizer, PoolError if the host fails otherwise."""
        self.loop = loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # From the loop's thread: the host's PR_SET_PDEATHSIG follows the forking thread.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "subway.frontend.grammar_host", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self._ctrl = ours
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._open, [self._proc, ours])
        try:
            await loop.sock_sendall(ours, encode(self.init))
            async with asyncio.timeout(timeout):
                data = await loop.sock_recv(ours, CTRL_MAX)
            if not data:
                raise PoolError("the grammar compiler's process exited at start")
            ready = msgspec.msgpack.decode(data, type=HostReady)
            if ready.error:
                raise PoolStartError(ready.error)
            for _ in range(self.workers):
                self._release(await self._fork())
        except TimeoutError:
            self.close()
            raise PoolError(f"the grammar compiler did not start within {timeout:g} s") from None
        except BaseException:
            self.close()
            raise

    async def compile(self, payload: bytes, deadline: float | None) -> str | None:
        """Compile the msgpack-encoded `Grammar` in a worker by `deadline` (loop time; None:
        no limit): None if it compiled, else xgrammar's message. Raises PoolBusy (no worker
        free in time), CompileTimeout (its worker was killed), WorkerDied (the worker
        ended during the compile) or PoolError."""
        if self.broken:
            raise PoolError(self.broken)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                worker = await self._acquire()
        except TimeoutError:
            raise PoolBusy() from None
        reply = None
        try:
            async with asyncio.timeout_at(deadline):
                await loop.sock_sendall(worker.sock, HEADER.pack(len(payload)) + payload)
                reply = await _recv_frame(loop, worker.sock, MAX_REPLY)
        except TimeoutError:
            raise CompileTimeout() from None
        except OSError:
            pass  # its socket broke: it died (reply stays None)
        finally:
            if reply is None:  # timed out, cancelled, or died: its state is unknown
                self._replace(worker)
            else:
                self._release(worker)
        if reply is None:
            raise WorkerDied()
        return msgspec.msgpack.decode(reply, type=Verdict).error

    def close(self) -> None:
        """Stop the host and the workers. Idempotent."""
        for task in self._refills:
            task.cancel()
        self._idle.clear()
        self._fail("the grammar compiler was closed")

    # ------------------------------------------------------------ workers

    async def _acquire(self) -> _Worker:
        """An idle worker that is alive (one that has exited, at its memory bound, is
        replaced: a grammar is never sent to a worker known to be gone)."""
        while True:
            while not self._idle:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except BaseException:  # timed out or cancelled, maybe just as it was woken:
                    if self._idle:  # the wake goes to the next in line
                        self._wake()
                    raise
                finally:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                if self.broken:
                    raise PoolError(self.broken)
            worker = self._idle.popleft()
            if _alive(worker.sock):
                return worker
            self._replace(worker)

    def _release(self, worker: _Worker) -> None:
        self._idle.append(worker)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` (the host reaps it) and fork another in its place."""
        self._open.pop(worker.pid, None)
        worker.sock.close()
        ctrl = self._ctrl
        try:
            if ctrl is None:
                raise OSError("no host")
            ctrl.send(encode(Kill(worker.pid)))
        except OSError as e:
            self._fail(f"the grammar compiler's process is gone ({e})")
            return
        task = asyncio.get_running_loop().create_task(self._refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _refill(self) -> None:
        try:
            self._release(await self._fork())
        except (OSError, PoolError, msgspec.DecodeError) as e:
            self._fail(f"the grammar compiler's process is gone ({e})")

    async def _fork(self) -> _Worker:
        loop = asyncio.get_running_loop()
        ctrl = self._ctrl
        if ctrl is None or self.broken:
            raise PoolError(self.broken or "the grammar compiler is not started")
        async with self._ctrl_lock:
            ours, theirs = socket.socketpair()
            try:
                socket.send_fds(ctrl, [encode(Fork())], [theirs.fileno()])
            except OSError:
                ours.close()
                raise
            finally:
                theirs.close()
            try:
                data = await loop.sock_recv(ctrl, CTRL_MAX)
            except BaseException as e:  # its answer would be read as the next fork's: no more
                ours.close()
                self._fail(f"the grammar compiler's process is gone ({e!r})")
                raise
        if not data:
            ours.close()
            raise PoolError("the grammar compiler's process exited")
        pid = msgspec.msgpack.decode(data, type=Forked).pid
        ours.setblocking(False)
        self._open[pid] = ours
        return _Worker(pid, ours)

    def _fail(self, reason: str) -> None:
        """The host is gone: no more compiles; whoever waits for a worker hears it now."""
        self.broken = self.broken or reason
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._finalizer()


def _alive(sock: socket.socket) -> bool:
    """Whether an idle worker's socket is open at its end (nothing is ever unread on it)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _shutdown(sockets: dict[int, socket.socket], host: list) -> None:
    """Close every socket and kill the host (its workers die with it): the pool's end."""
    proc, ctrl = host
    for sock in sockets.values():
        sock.close()
    sockets.clear()
    if ctrl is not None:
        ctrl.close()
    if proc is not None and proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


async def _recv_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int
) -> bytes | None:
    """One frame from a non-blocking socket; None at EOF or past `limit` bytes."""
    header = await _recv_exact(loop, sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > limit:
        return None
    return await _recv_exact(loop, sock, size)


async def _recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int
) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


# ---------------------------------------------------------------- the host and its workers


def read_frame(sock: socket.socket, limit: int) -> bytes | None:
    header = _read_exact(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    return None if size > limit else _read_exact(sock, size)


def _read_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)
