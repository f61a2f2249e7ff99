"""The launcher's watch over a ready engine: can it serve?

`LivenessProbe` asks the frontend over its private liveness socket (`frontend/liveness.py`),
one connection held for the whole run, never over the public HTTP port: there, clients
holding every connection the cap allows, or every file descriptor the frontend has, would
make the probe fail and `serve` (`tools/launch.py`) stop a healthy server. `/health` over
HTTP (`health_reason`) is asked only of a frontend that has no liveness socket.
`HealthWatch` turns the probe's answers into the verdict `serve` acts on: an engine that
cannot serve for `UNHEALTHY_EXIT_S` is stopped.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

from subway.frontend.liveness import liveness_path, parse_answer
from subway.ipc.config import EngineConfig

UNHEALTHY_EXIT_S = 15.0  # a ready engine whose health check fails this long is stopped
HEALTH_PROBE_S = 1.0
PROBE_TIMEOUT_S = 2.0  # an answer later than this is none


def health_reason(config: EngineConfig, timeout: float = 2.0) -> str | None:
    """None when /health answers 200; else why not (its reason, or no answer)."""
    url = f"http://{config.server.host}:{config.server.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read()).get("reason") or f"HTTP {e.code}"
        except (ValueError, OSError, AttributeError):
            return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"no answer ({e})"


class LivenessProbe:
    """The launcher's question to its frontend, can the engine serve, over the frontend's
    liveness socket (`frontend/liveness.py`): one connection, kept across probes, so that
    no probe needs a descriptor or a connection slot of the frontend's. A probe that gets
    no answer within `PROBE_TIMEOUT_S` drops the connection (a late answer must not be
    read as the next one's) and the next probe connects again. Until that socket has
    answered once, a frontend without one (it could not listen) is asked `/health`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.path = liveness_path(config)
        self.sock: socket.socket | None = None
        self.private = False  # the liveness socket has answered: no fallback any more

    def reason(self) -> str | None:
        """None when the engine can serve; else why not (the frontend's reason, or none)."""
        if self.sock is None:
            try:
                self.sock = self._connect()
            except OSError as e:
                if self.private:
                    return f"no answer on {self.path} ({e})"
                return health_reason(self.config, PROBE_TIMEOUT_S)
        try:
            reason = parse_answer(self._ask(self.sock))
        except (OSError, ValueError) as e:
            self.close()
            return f"no answer on {self.path} ({e or type(e).__name__})"
        self.private = True
        return reason

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        return sock

    @staticmethod
    def _ask(sock: socket.socket) -> bytes:
        """One question, one line back within `PROBE_TIMEOUT_S` (TimeoutError if not)."""
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        sock.sendall(b"?\n")
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or len(line) > 4096:
                raise TimeoutError("no whole answer in time")
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionResetError("the frontend closed the liveness socket")
            line += chunk
        return line

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class HealthWatch:
    """The launcher's view of a ready engine, probed every `HEALTH_PROBE_S` through its
    `LivenessProbe`. One that fails (unhealthy with a reason, or no answer: a hung
    frontend or scheduler) for `UNHEALTHY_EXIT_S` means the engine cannot serve; `serve`
    then stops everything."""

    def __init__(self, probe: LivenessProbe) -> None:
        self.probe = probe
        self.last_probe = 0.0
        self.failing_since: float | None = None

    def due(self) -> bool:
        return time.monotonic() - self.last_probe >= HEALTH_PROBE_S

    def check(self) -> str | None:
        self.last_probe = time.monotonic()
        reason = self.probe.reason()
        if reason is None:
            self.failing_since = None
            return None
        if self.failing_since is None:
            self.failing_since = self.last_probe
        failing = time.monotonic() - self.failing_since
        if failing < UNHEALTHY_EXIT_S:
            return None
        return f"the engine has been unhealthy for {failing:.0f} s ({reason})"
