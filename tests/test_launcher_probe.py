"""The launcher's liveness check cannot be starved (issue 43).

`subway serve` asks its frontend whether the engine can serve over a private Unix
socket held open for the whole run (`frontend/liveness.py`, `tools/health_watch.py`), not
over the public HTTP port, and raises its open-file limit at start. Checked in
process (the socket's answers, a hung loop, the limit), then black-box: clients
holding every connection `--max-connections` allows, or more sockets than the
frontend's inherited soft file limit, for longer than the launcher's unhealthy-exit
window, do not make `serve` stop itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest

from subway.ipc.config import EngineConfig
from subway.tools.launch import UNHEALTHY_EXIT_S

from serving import Server, until

# The in-process tests import what they test where they use it, so that the served ones
# also run (and fail as they should) against a subway that has none of it.

# ------------------------------------------------------------------ in process


class LoopThread:
    """An event loop on a thread of its own, serving a `LivenessServer`."""

    def __init__(self, path: str, judge) -> None:
        from subway.frontend.liveness import LivenessServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = LivenessServer(path, judge)
        assert self.run(self.server.start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.run(self.server.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_the_probe_reads_the_frontends_verdict_over_one_connection(tmp_path):
    from subway.tools.launch import LivenessProbe

    config = EngineConfig.build(run_dir=str(tmp_path), run_id="lp")
    state: dict[str, str | None] = {"reason": None}
    fe = LoopThread(str(tmp_path / "liveness.sock"), lambda: state["reason"])
    probe = LivenessProbe(config)
    try:
        assert probe.reason() is None
        sock = probe.sock
        state["reason"] = "engine silent"
        assert probe.reason() == "engine silent"
        assert probe.sock is sock  # the same connection: no new descriptor a probe
        assert (tmp_path / "liveness.sock").stat().st_mode & 0o077 == 0
    finally:
        probe.close()
        fe.close()
    assert not (tmp_path / "liveness.sock").exists()


def test_a_hung_frontend_loop_is_no_answer_and_no_fallback(tmp_path):
    from subway.tools.launch import LivenessProbe

    config = EngineConfig.build(run_dir=str(tmp_path), run_id="lp")
    fe = LoopThread(str(tmp_path / "liveness.sock"), lambda: None)
    probe = LivenessProbe(config)
    release = threading.Event()
    try:
        assert probe.reason() is None
        fe.loop.call_soon_threadsafe(release.wait, 30)  # the loop is stuck in a callback
        t0 = time.monotonic()
        reason = probe.reason()
        assert reason is not None and "no answer" in reason
        assert time.monotonic() - t0 < 3.0
    finally:
        release.set()
        probe.close()
        fe.close()
    # The socket gone (the frontend died): a failure, not a fall back to HTTP.
    reason = probe.reason()
    assert reason is not None and "liveness.sock" in reason


def test_a_frontend_without_the_socket_is_asked_over_http(tmp_path):
    from subway.tools.launch import LivenessProbe

    config = EngineConfig.build(run_dir=str(tmp_path), run_id="lp", port=1)
    reason = LivenessProbe(config).reason()
    assert reason is not None and reason.startswith("no answer (")  # health_reason's words


def test_a_frontend_under_serve_answers_while_its_app_lives(tmp_path, monkeypatch):
    """`serve_liveness` (the frontend process's hook): the socket is served for the app's
    lifespan, with the verdict /health would give; not at all in a frontend started alone."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from subway.frontend.liveness import serve_liveness
    from subway.tools.launch import LivenessProbe

    config = EngineConfig.build(run_dir=str(tmp_path), run_id="lp")
    link = types.SimpleNamespace(healthy=False, ready=True, error="worker 0 died")
    engine = types.SimpleNamespace(draining=False, link=link)
    alone = FastAPI()
    serve_liveness(alone, config, engine)
    with TestClient(alone):
        assert not (tmp_path / "liveness.sock").exists()
    monkeypatch.setenv("SUBWAY_PARENT_PID", "1")
    app = FastAPI()
    serve_liveness(app, config, engine)
    probe = LivenessProbe(config)
    try:
        with TestClient(app):
            assert probe.reason() == "worker 0 died"
            link.healthy = True
            assert probe.reason() is None
    finally:
        probe.close()
    assert not (tmp_path / "liveness.sock").exists()


def test_answers_round_trip_and_junk_is_refused():
    from subway.frontend.liveness import answer, parse_answer

    assert parse_answer(answer(None)) is None
    assert parse_answer(answer("x" * 9000)) == "x" * 500
    for junk in (b"[]\n", b'{"ok": 1}\n', b"nope\n"):
        with pytest.raises(ValueError):
            parse_answer(junk)


def test_serve_raises_the_open_file_limit_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import resource; from subway.tools.limits import raise_fd_limit; "
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    low = min(128, hard)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
    ).stdout.split()  # fmt: skip
    assert out == [str(hard), str(hard)]


# ------------------------------------------------------------------ served


@contextlib.contextmanager
def soft_nofile(limit: int):
    """This process's soft open-file limit lowered to `limit` (what a child inherits)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class IdleClients:
    """`n` connections to `port` that never send a byte, kept at `n`: one the server
    closes (a refusal past the cap, a reset) is opened again at the next `keep`."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.socks = [self._open() for _ in range(n)]

    def _open(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def keep(self) -> None:
        readable, _, _ = select.select(self.socks, [], [], 0)
        for sock in readable:  # an idle client reads only an answer or the close
            self.socks.remove(sock)
            sock.close()
            with contextlib.suppress(OSError):
                self.socks.append(self._open())

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []


def serves_through(server: Server, clients: IdleClients, seconds: float) -> bool:
    """Whether `serve` runs at every poll while `clients` are kept for `seconds` (a
    bounded poll of the process, paced, not a sleep to wait on something)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        clients.keep()
        if server.proc.poll() is not None:
            return False
        time.sleep(0.2)
    return server.proc.poll() is None


# Twice the launcher's window: its watch, had it failed all along, would have stopped
# serve and serve would have exited well within this.
HOLD_S = 2 * UNHEALTHY_EXIT_S


def launcher_watches(server: Server) -> None:
    """Until the launcher has seen the engine ready itself (it prints so): its watch runs
    from then on, and a flood before that would test nothing."""
    until(lambda: "press Ctrl-C to stop" in server.read_output(), 60)


def still_serves(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_idle_connections_at_the_cap_do_not_stop_serve(tiny_models):
    cap = 16
    s = Server(tiny_models["llama"], "--max-connections", str(cap), "--header-timeout", "120",
               "--num-kv-blocks", "64")  # fmt: skip
    clients = None
    try:
        launcher_watches(s)
        clients = IdleClients(s.port, cap + 4)  # the 4 past the cap: 503, closed, again
        assert serves_through(s, clients, HOLD_S), s.read_output()[-2000:]
        clients.close()
        still_serves(s)
        assert "unhealthy" not in s.read_output()
    finally:
        if clients is not None:
            clients.close()
        assert s.stop() == 0


@pytest.mark.slow
def test_more_sockets_than_the_inherited_file_limit_do_not_stop_serve(tiny_models):
    """`serve` started with a soft limit of 256 descriptors (a distribution's 1024 is the
    same fault at a larger flood), 400 idle clients under a cap of 1024 connections."""
    with soft_nofile(256):
        s = Server(tiny_models["llama"], "--max-connections", "1024", "--header-timeout",
                   "120", "--num-kv-blocks", "64")  # fmt: skip
    clients = None
    try:
        launcher_watches(s)
        clients = IdleClients(s.port, 400)
        assert serves_through(s, clients, HOLD_S), s.read_output()[-2000:]
        clients.close()
        still_serves(s)
        assert "unhealthy" not in s.read_output()
    finally:
        if clients is not None:
            clients.close()
        assert s.stop() == 0
