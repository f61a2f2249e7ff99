"""ZeroMQ socket helpers: each process makes its sockets here, in one way."""

from __future__ import annotations

import os

import zmq


def _prepare(addr: str) -> None:
    if addr.startswith("ipc://"):
        os.makedirs(os.path.dirname(addr[len("ipc://") :]) or ".", exist_ok=True)


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
