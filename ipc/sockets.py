"""ZeroMQ socket helpers: each process makes its sockets here, in one way."""

from __future__ import annotations

import os
import stat

import zmq

from subway.ipc.config import IpcConfig


def secure_dir(path: str) -> bool:
    """Make `path` with mode 0700 if it is missing (True: this call made it). One that is
    there must be a real folder of this user that nobody else may write to; else
    PermissionError, since another user could put sockets of their own there."""
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{path} must be a folder of this user that others cannot write to "
            f"(mode {st.st_mode & 0o777:o}, owner uid {st.st_uid})"
        )
    return False


def _prepare(addr: str) -> None:
    if addr.startswith("ipc://"):
        secure_dir(os.path.dirname(addr[len("ipc://") :]) or ".")


class Sockets:
    """Makes one process's internal-plane sockets, all in one way: linger 0, every
    message bounded by `ipc.max_message_bytes` (ZMQ_MAXMSGSIZE: a larger one drops the
    connection that sent it), and CurveZMQ on tcp:// when the config names a key file."""

    def __init__(self, ctx: zmq.Context, ipc: IpcConfig) -> None:
        self.ctx = ctx
        self.ipc = ipc

    def _opts(self, opts: dict[str, int]) -> dict[str, int]:
        return {"MAXMSGSIZE": self.ipc.max_message_bytes, **opts}

    def bind(self, kind: int, addr: str, **opts: int) -> zmq.Socket:
        return bind(self.ctx, kind, addr, **self._opts(opts))

    def connect(self, kind: int, addr: str, **opts: int) -> zmq.Socket:
        return connect(self.ctx, kind, addr, **self._opts(opts))


def bind(ctx: zmq.Context, kind: int, addr: str, **opts: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    _prepare(addr)
    sock.bind(addr)
    return sock


def connect(ctx: zmq.Context, kind: int, addr: str, **opts: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(addr)
    return sock


def cleanup_ipc(*addrs: str) -> None:
    """Remove the socket files of ipc:// addresses this process bound."""
    for addr in addrs:
        if addr.startswith("ipc://"):
            try:
                os.unlink(addr[len("ipc://") :])
            except FileNotFoundError:
                pass
