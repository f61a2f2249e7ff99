"""ZeroMQ socket helpers: each process makes its sockets here, in one way."""

from __future__ import annotations

import os
import stat

import zmq

from subway.ipc import curve
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
    """Makes one process's internal-plane sockets, all in one way: linger 0, no
    ZMQ_MAXMSGSIZE (a larger message would drop the whole connection that sent it, and a
    worker or a scheduler takes a lost link for a dead peer: the receivers' `Codec`s
    refuse and count a frame over `ipc.max_message_bytes` instead), and CurveZMQ on every
    tcp:// address (so that only holders of the engine's key can send at all) (`ipc/curve.py`): a
    binding socket is a CURVE server whose ZAP handler admits only the engine's own key, a
    connecting one authenticates with that key. A tcp:// address without a key file is
    refused (ValueError naming --curve-key-file); ipc:// sockets are left as they are, in
    their 0700 run folder. Call `close()` before `ctx.term()`: the ZAP handler, started
    at the first tcp:// bind, holds a socket of the context."""

    def __init__(self, ctx: zmq.Context, ipc: IpcConfig) -> None:
        self.ctx = ctx
        self.ipc = ipc
        self._keys: curve.KeyPair | None = None
        self._auth: curve.Authenticator | None = None

    def _keypair(self, addr: str) -> curve.KeyPair:
        if self._keys is None:
            self._keys = curve.engine_keys(self.ipc, addr)  # read once per process
        return self._keys

    def bind(
        self, kind: int, addr: str, socket_class: type[zmq.Socket] | None = None, **opts: int
    ) -> zmq.Socket:
        """`socket_class`: the class to make (default: the context's own)."""
        if not curve.is_tcp(addr):
            return bind(self.ctx, kind, addr, socket_class, **opts)
        keys = self._keypair(addr)
        if self._auth is None:  # before the bind, so that no handshake goes unchecked
            self._auth = curve.Authenticator(self.ctx, keys.public)
        server = {
            "CURVE_SERVER": 1,
            "CURVE_SECRETKEY": keys.secret,
            "ZAP_DOMAIN": curve.ZAP_DOMAIN.encode(),
        }
        return bind(self.ctx, kind, addr, socket_class, **opts, **server)

    def connect(self, kind: int, addr: str, **opts: int) -> zmq.Socket:
        if not curve.is_tcp(addr):
            return connect(self.ctx, kind, addr, **opts)
        keys = self._keypair(addr)
        client = {
            "CURVE_SERVERKEY": keys.public,
            "CURVE_PUBLICKEY": keys.public,
            "CURVE_SECRETKEY": keys.secret,
        }
        return connect(self.ctx, kind, addr, **opts, **client)

    @property
    def denied(self) -> int:
        """CurveZMQ handshakes refused so far (peers without the engine's key)."""
        return self._auth.provider.denied if self._auth is not None else 0

    def close(self) -> None:
        """Stop the ZAP handler, if one started. Idempotent."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()


_POLLIN = int(zmq.POLLIN)


def has_message(sock: zmq.Socket) -> bool:
    """Whether a read without blocking would find a message now. Loops that read until
    the socket is empty ask this rather than wait for `zmq.Again`: pyzmq builds that
    exception (with its strerror) at twice the cost of the question, and the scheduler's
    loop empties four sockets on every turn. Reading the socket's events also rearms its
    edge-triggered file descriptor (`zmq.FD`)."""
    return bool(sock.get(zmq.EVENTS) & _POLLIN)


def bind(
    ctx: zmq.Context,
    kind: int,
    addr: str,
    socket_class: type[zmq.Socket] | None = None,
    **opts: int | bytes,
) -> zmq.Socket:
    sock = ctx.socket(kind, socket_class=socket_class)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    _prepare(addr)
    sock.bind(addr)
    return sock


def connect(ctx: zmq.Context, kind: int, addr: str, **opts: int | bytes) -> zmq.Socket:
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
