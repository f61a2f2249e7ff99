"""The launcher's private line to the frontend: is its event loop alive, can it serve.

`subway serve` stops everything when its engine has been unable to serve for a while
(`tools/health_watch.py`, `HealthWatch`). Asked over the public HTTP port, that question
shares what any client can use up: the connection cap (`--max-connections`: past it a
connection gets a canned 503 before anything is parsed) and the process's file
descriptors (past RLIMIT_NOFILE, accept fails and the probe gets no answer). A client
holding `--max-connections` idle sockets would then make the launcher stop a healthy
server: a denial of service by idle sockets.

So the frontend also listens on a Unix socket in the run folder (`liveness_path`: a
folder of this user, mode 0700, that `serve` made; the socket itself 0600), which no
HTTP client can reach and no HTTP limit counts. The launcher connects once and keeps
that connection: each probe is one line out ("?") and one JSON line back
(`{"ok": true}`, or `{"ok": false, "reason": ...}`, the verdict `/health` gives), on a
file descriptor both sides already hold, so neither the cap nor a process out of
descriptors can refuse it. The answer is made on the frontend's event loop, the one
that serves HTTP: a hung loop shows as no answer, as it would on `/health`.

At most `MAX_PEERS` connections are served at once (the launcher needs one); a line
longer than `MAX_LINE` bytes ends its connection.

The frontend process serves it through `serve_liveness(app, config, engine)`, which
wraps the app's lifespan: the socket is up before uvicorn binds the HTTP port and gone
when the lifespan ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from subway.frontend.engine import Engine
from subway.ipc.config import EngineConfig

log = logging.getLogger("subway.frontend")

SOCKET_NAME = "liveness.sock"
MAX_PEERS = 4
MAX_LINE = 256
MAX_REASON = 500  # characters of a reason in an answer


def liveness_path(config: EngineConfig) -> str:
    """Where the frontend of `config` listens for the launcher's probe."""
    return os.path.join(config.ipc.run_dir, SOCKET_NAME)


def verdict(engine: Engine) -> str | None:
    """None when the frontend can serve; else why not. The same judgement as `/health`
    (`server.py`): draining; several engines: none serving; one: its link not healthy."""
    if engine.draining:
        return "draining"
    clients = getattr(engine, "clients", None)
    if clients is not None and len(clients) > 1:  # an EngineGroup of several engines
        serving, states = engine.health()
        if serving:
            return None
        return "; ".join(f"engine {s['engine']}: {s['state']}" for s in states)
    link = engine.link
    if link.healthy:
        return None
    return link.error or ("engine not ready" if not link.ready else "engine silent")


def answer(reason: str | None) -> bytes:
    """One answer line."""
    body = {"ok": True} if reason is None else {"ok": False, "reason": reason[:MAX_REASON]}
    return json.dumps(body).encode() + b"\n"


def parse_answer(line: bytes) -> str | None:
    """None for an ok answer; else its reason (ValueError if `line` is not an answer)."""
    body = json.loads(line)
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        raise ValueError(f"not a liveness answer: {line[:80]!r}")
    return None if body["ok"] else str(body.get("reason") or "unhealthy")


class LivenessServer:
    """The Unix socket at `path`, answering each line with `judge()`'s verdict."""

    def __init__(self, path: str, judge: Callable[[], str | None]) -> None:
        self.path = path
        self.judge = judge
        self._server: asyncio.AbstractServer | None = None
        self._peers: set[asyncio.StreamWriter] = set()

    async def start(self) -> bool:
        """Listen; False (logged) where that cannot be done: the frontend serves on, and
        the launcher falls back to `/health`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)  # a socket left by a frontend of this run that died
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(MAX_PEERS)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE)
        except OSError as e:
            sock.close()
            log.warning("no liveness socket at %s (%s): the launcher probes /health", self.path, e)
            return False
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._peers) >= MAX_PEERS:
            writer.close()
            return
        self._peers.add(writer)
        try:
            while await reader.readline():
                writer.write(answer(self.judge()))
                await writer.drain()
        except (ConnectionError, ValueError):  # ValueError: a line past MAX_LINE
            pass
        finally:
            self._peers.discard(writer)
            writer.close()

    async def aclose(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._peers):
            writer.close()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def serve_liveness(app: Any, config: EngineConfig, engine: Engine) -> None:
    """Make `app`'s lifespan (a FastAPI app's) serve the liveness socket: from the moment
    the engine client has started (its sockets made the run folder, if anything had to)
    until the lifespan ends; uvicorn binds the HTTP port after the lifespan's start, so
    the socket is there before any client can connect. Only in a frontend that `serve`
    started (it names itself in SUBWAY_PARENT_PID): a frontend started alone has no
    launcher to answer."""
    if not os.environ.get("SUBWAY_PARENT_PID"):
        return
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any):
        async with inner(a) as state:
            server = LivenessServer(liveness_path(config), lambda: verdict(engine))
            await server.start()
            try:
                yield state
            finally:
                await server.aclose()

    app.router.lifespan_context = lifespan
