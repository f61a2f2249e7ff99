"""Who a peer is, and whether it still lives: judged by identity, never by a socket event.

A disconnect on a bound tcp:// port says only that *some* connection closed: a
port scanner or a load balancer's probe causes one too. So a process that
sees one asks whether the peer it knows (by pid, on this host) has died; a
peer on another host is judged by its heartbeat alone.
"""

from __future__ import annotations

import logging
import os
import socket

# A process killed with SIGKILL closes its sockets while it exits, so its disconnect can
# come before its pid reads as dead: whoever saw a disconnect checks again this long.
RECHECK_S = 2.0


def this_host() -> str:
    return socket.gethostname()


def process_alive(pid: int, host: str) -> bool | None:
    """Whether process `pid` on `host` lives; None when that cannot be told from here
    (another host, or no pid known)."""
    if pid <= 0 or (host and host != this_host()):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """A dead child its parent has not reaped yet still answers kill(0): read its state."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class Refusals:
    """Messages refused from one kind of peer: counted, and logged once per kind of fault
    (a flood of forgeries must not flood the log too)."""

    def __init__(self, log: logging.Logger, peer: str) -> None:
        self.log = log
        self.peer = peer
        self.count = 0
        self._logged: set[str] = set()

    def refuse(self, kind: str, detail: str) -> None:
        self.count += 1
        if kind not in self._logged:
            self._logged.add(kind)
            self.log.error("refused a message from %s (%s): %s; further ones only counted",
                           self.peer, kind, detail)  # fmt: skip
