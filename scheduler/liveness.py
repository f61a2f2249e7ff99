"""Who is still there: the frontend's liveness, and the drain that SIGTERM starts.

The frontend is known by the pid and host of its FrontendHello and kept by its
heartbeat (FrontendAlive): it is gone when that pid has died (checked for
`RECHECK_S` after any disconnect of the request socket, which a port probe can
cause too) or when it has been silent for `FRONTEND_SILENCE_S` (hung, or on a
host whose pids we cannot see).

SIGTERM drains: the loop serves on until nothing is left to do and the
frontend has gone (or been quiet for `DRAIN_QUIET_S`), or until
`shutdown_timeout + DRAIN_GRACE_S`; a second SIGINT stops it at once.
"""

from __future__ import annotations

import logging
import signal
import time

from subway.ipc.messages import FRONTEND_HEARTBEAT_S
from subway.ipc.peers import RECHECK_S, process_alive

log = logging.getLogger("subway.scheduler")

FRONTEND_SILENCE_S = 10 * FRONTEND_HEARTBEAT_S  # a frontend this quiet is gone: abort its work
DRAIN_QUIET_S = 0.5  # after SIGTERM, idle this long with no frontend message: exit
DRAIN_GRACE_S = 10.0  # after SIGTERM, exit after shutdown_timeout + this at the latest


class FrontendWatch:
    """The one frontend this scheduler serves, and whether it is still alive."""

    def __init__(self) -> None:
        self.peer: tuple[int, str] | None = None  # (pid, host) of its hello
        self.seen = 0.0  # time.monotonic() of its last message
        self.recheck_until = 0.0  # after a disconnect: check its pid until then

    def replaced_by(self, pid: int, host: str) -> int | None:
        """The pid of the frontend that a hello from (`pid`, `host`) replaces, if another."""
        old = self.peer
        return old[0] if old is not None and old != (pid, host) else None

    def hello(self, pid: int, host: str) -> None:
        """A frontend (re)starts: it is now the one."""
        self.peer, self.seen = (pid, host), time.monotonic()

    def forget(self) -> None:
        """Its requests were aborted: a heartbeat may bring it back."""
        self.peer = None

    def heard(self) -> None:
        """A message from the frontend."""
        self.seen = time.monotonic()

    def heartbeat(self, pid: int, host: str) -> None:
        """Its heartbeat: also brings back a frontend that a silence cost its requests."""
        self.seen = time.monotonic()
        if self.peer is None:
            self.peer = (pid, host)

    def check(self, disconnected: bool) -> str | None:
        """Why the frontend is gone (then forgotten: its requests must be aborted), or None."""
        peer = self.peer
        if peer is None:
            return None
        now = time.monotonic()
        if disconnected:  # its pid may still read as alive while the process exits
            self.recheck_until = now + RECHECK_S
        if now < self.recheck_until and process_alive(*peer) is False:
            return f"the frontend (pid {peer[0]}) died"
        if now - self.seen > FRONTEND_SILENCE_S:
            return f"the frontend (pid {peer[0]}) is silent"
        return None

    def quiet(self, now: float) -> bool:
        """No frontend, or none heard from for `DRAIN_QUIET_S`."""
        return self.peer is None or now - self.seen > DRAIN_QUIET_S


class Drain:
    """SIGTERM's drain: asked once, it ends when `done` says so."""

    def __init__(self, shutdown_timeout: float) -> None:
        self.limit_s = shutdown_timeout + DRAIN_GRACE_S
        self.since: float | None = None  # when it began
        self.stop_now = False  # a second SIGINT

    def request(self, signum: int = 0) -> None:
        """First signal: drain. A second SIGINT: stop now (a second SIGTERM changes nothing:
        the launcher and systemd may both send one)."""
        if self.since is None:
            self.since = time.monotonic()
            log.info("draining: serving what is in flight, then exiting")
        elif signum != signal.SIGTERM:
            self.stop_now = True

    def done(self, busy: bool, frontend: FrontendWatch) -> bool:
        """After SIGTERM: nothing left to do (`busy` false) and no frontend that may still
        send, or the drain's time is up."""
        if self.since is None:
            return False
        now = time.monotonic()
        if now - self.since > self.limit_s:
            log.warning("drain timed out; exiting")
            return True
        return not busy and frontend.quiet(now)
