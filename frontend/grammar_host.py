"""The grammar pool's own processes (`grammar_pool.py` is the frontend's side): the host,
which imports xgrammar once and forks workers on request, and each worker, which compiles
one grammar at a time. Run as `python -m subway.frontend.grammar_host FD`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import sys

import msgspec

from subway.frontend.grammar_pool import (  # the protocol both sides share
    CTRL_MAX,
    HEADER,
    MAX_FRAME,
    NICE,
    PR_SET_PDEATHSIG,
    WORKER_MAX_MEMORY,
    WORKER_MAX_PRIVATE,
    Fork,
    Forked,
    HostInit,
    HostReady,
    Kill,
    Verdict,
    encode,
    read_frame,
)
from subway.ipc.messages import Grammar


def _die_with_parent(parent: int) -> None:
    """SIGKILL when `parent` exits (or now, if it already has)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def _host(fd: int) -> None:
    """The host: build the tokenizer info, then fork and kill workers as the frontend asks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the frontend decides
    _title("host")
    ctrl = socket.socket(fileno=fd)
    data = ctrl.recv(CTRL_MAX)
    if not data:
        return
    init = msgspec.msgpack.decode(data, type=HostInit)
    _die_with_parent(init.frontend_pid)
    try:
        info = _tokenizer_info(init)
    except Exception as e:  # noqa: BLE001 -- any failure means no structured outputs
        from subway.frontend.grammar import clean_message

        ctrl.send(encode(HostReady(error=clean_message(e))))
        return
    os.nice(NICE)  # after the start, which a request waits for; the workers inherit it
    ctrl.send(encode(HostReady()))
    workers: set[int] = set()
    try:
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, CTRL_MAX, 1)
            if not msg:
                return  # the frontend is gone or closed the pool
            req = msgspec.msgpack.decode(msg, type=Fork | Kill)
            if isinstance(req, Fork) and fds:
                pid = _fork_worker(fds[0], ctrl, info)
                os.close(fds[0])
                workers.add(pid)
                ctrl.send(encode(Forked(pid)))
            elif isinstance(req, Kill) and req.pid in workers:
                _kill(req.pid)
                workers.discard(req.pid)
            else:
                for extra in fds:
                    os.close(extra)
    finally:
        for pid in workers:
            _kill(pid)


def _title(role: str) -> None:
    """What `ps` shows: `subway grammar-compiler host` (not a kind `proc_title` parses)."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(f"subway grammar-compiler {role}")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # its pid stays taken (a zombie) until here: never a stranger's


def _tokenizer_info(init: HostInit):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from subway.frontend.grammar import compile_grammar

    tokenizer = AutoTokenizer.from_pretrained(init.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=init.vocab_size, stop_token_ids=list(init.eos_token_ids) or None
    )
    # One compile here, so that what xgrammar builds on first use is built once, before
    # the forks share it (a new worker's first compile took 3x its later ones without).
    compile_grammar(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False),
                    Grammar("json_object"))  # fmt: skip
    return info


def _fork_worker(fd: int, ctrl: socket.socket, info) -> int:
    host = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        ctrl.close()
        _die_with_parent(host)
        _title("worker")
        _work(fd, info)
    except BaseException:  # noqa: BLE001 -- a worker never returns into the host's loop
        code = 1
    os._exit(code)


def _work(fd: int, info) -> None:
    """A worker: compile each grammar that comes, answer its verdict, until EOF."""
    import xgrammar as xgr

    from subway.frontend.grammar import clean_message, compile_grammar

    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _cap_memory()
    while True:
        payload = read_frame(sock, MAX_FRAME)
        if payload is None:
            return
        done = False
        try:
            compile_grammar(compiler, msgspec.msgpack.decode(payload, type=Grammar))
            error = None
        except MemoryError:
            error, done = "compiling it needs more memory than this server allows", True
        except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError and others
            error = clean_message(e)
        reply = encode(Verdict(error))
        sock.sendall(HEADER.pack(len(reply)) + reply)
        if done or _private_bytes() > WORKER_MAX_PRIVATE:
            return  # the frontend sees EOF at its next compile and forks a new worker


def _statm() -> list[int]:
    with open("/proc/self/statm") as f:
        return [int(x) * resource.getpagesize() for x in f.read().split()]


def _private_bytes() -> int:
    size, resident, shared, *_ = _statm()
    return resident - shared


def _cap_memory() -> None:
    """An address-space limit of what the worker has now plus WORKER_MAX_MEMORY."""
    limit = _statm()[0] + WORKER_MAX_MEMORY
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


if __name__ == "__main__":
    _host(int(sys.argv[1]))
