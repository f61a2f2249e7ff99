"""Many hosts: two `subway serve` behind vllm-router, the recipe in the README's "Many hosts".

Two servers on loopback stand for two hosts. The router runs its default policy,
`cache_aware`: concurrent requests spread over both servers, requests that share a
prefix stay on one. Its health checks of `/health` take a server whose engine went
silent (503, the frontend still up) out of rotation and put it back once it answers
200 again; a server that dies is routed around.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import build_tiny_model
from serving import Server, free_port, until

INSTALL = (
    "vllm-router is not installed: the many-hosts tests run Subway behind it. Install it "
    "with `pip install 'vllm-router>=0.1.17,<0.2'` (it is in the `test` extra: "
    "`pip install -e '.[test]'`); it is a Rust binary wheel for Linux x86_64/aarch64 "
    "(glibc >= 2.28) that pulls no torch."
)


def _router_executable() -> str:
    if importlib.util.find_spec("vllm_router") is None:
        pytest.fail(INSTALL)
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    exe = here if os.access(here, os.X_OK) else shutil.which("vllm-router")
    if exe is None:
        pytest.fail(INSTALL)
    return exe


class Router:
    """vllm-router in front of `backends`, ready once it holds every one healthy."""

    def __init__(self, backends: list[Server], policy: str = "cache_aware") -> None:
        exe = _router_executable()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker-urls", *(b.url for b in backends), "--policy", policy]
        cmd += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
        cmd += ["--health-success-threshold", "1", "--worker-startup-check-interval", "1"]
        # Its Prometheus exporter binds 29000 by default; a taken port is a panic.
        cmd += ["--prometheus-port", str(free_port())]
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            until(lambda: self._started() and all(self.sees_healthy(b) for b in backends), 60)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"vllm-router did not become ready:\n{self.read_output()}") from None

    def _started(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited early:\n{self.read_output()}")
        return True

    def workers(self) -> dict[str, bool]:
        """{backend url: healthy}, as the router's health checks last found them."""
        try:
            body = httpx.get(self.url + "/workers", timeout=2).json()
        except (httpx.HTTPError, json.JSONDecodeError):
            return {}
        return {w["url"]: w["is_healthy"] for w in body["workers"]}

    def sees_healthy(self, backend: Server) -> bool:
        return self.workers().get(backend.url) is True

    def sees_unhealthy(self, backend: Server) -> bool:
        return self.workers().get(backend.url) is False

    def read_output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def backends(tmp_path_factory, default_model):
    _router_executable()  # fails at once, before the servers start, if it is missing
    model = build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny") / "llama"), default_model)
    flags = ("--served-model-name", "tiny", "--max-model-len", "512", "--num-kv-blocks", "96")
    with ThreadPoolExecutor(2) as pool:  # two hosts start side by side
        futures = [pool.submit(Server, model, *flags) for _ in range(2)]
        servers = [f.result() for f in futures]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(backends):
    r = Router(backends)
    yield r
    r.stop()


def served(server: Server) -> float:
    """Requests this backend finished, by any finish reason."""
    return server.metrics().get("subway:request_success_total", 0.0)


async def _request(client: httpx.AsyncClient, kind: str, text: str, max_tokens: int) -> str:
    """One request through the router: `kind` is completion|chat, with -stream or not."""
    chat = kind.startswith("chat")
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "min_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not kind.endswith("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    body["stream"] = True
    out, done = [], False
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            out.append((choice["delta"].get("content") or "") if chat else choice["text"])
    assert done, "the stream ended without [DONE]"
    return "".join(out)


def _send(url: str, requests: list[tuple[str, str]], max_tokens: int = 4) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            jobs = [_request(client, kind, text, max_tokens) for kind, text in requests]
            return await asyncio.gather(*jobs)

    return asyncio.run(run())


KINDS = ("completion", "completion-stream", "chat", "chat-stream")


def test_concurrent_requests_spread_over_both_hosts_streaming_included(backends, router):
    before = [served(b) for b in backends]
    # Prompts that share no prefix: the policy sends each to the least loaded server, and
    # 32 tokens each keep the first ones in flight while the later ones are routed.
    requests = [(KINDS[i % 4], f"{chr(ord('a') + i)}{i} unrelated topic") for i in range(8)]
    texts = _send(router.url, requests, max_tokens=32)
    assert all(t for t in texts), texts
    delta = [served(b) - n for b, n in zip(backends, before, strict=True)]
    assert sum(delta) == len(requests), delta
    assert min(delta) > 0, f"one server served all of them: {delta}"


def test_a_shared_prefix_stays_on_one_host(backends, router):
    before = [served(b) for b in backends]
    prefix = "You are a terse assistant for a railway timetable office. " * 4
    for i in range(6):
        _send(router.url, [("completion", f"{prefix}Question {i}: when is the next train?")])
    delta = sorted(served(b) - n for b, n in zip(backends, before, strict=True))
    assert delta == [0, 6], delta


def test_a_host_that_cannot_serve_is_routed_around(backends, router):
    sick, well = backends
    scheduler = sick.child("scheduler")
    scheduler.suspend()  # SIGSTOP: the engine goes silent, the frontend still answers
    try:
        until(lambda: httpx.get(sick.url + "/health", timeout=2).status_code == 503, 15)
        assert httpx.get(sick.url + "/health", timeout=2).json()["status"] == "unhealthy"
        until(lambda: router.sees_unhealthy(sick), 15)
        before = (served(sick), served(well))
        texts = _send(router.url, [(kind, f"{kind} while one host is sick") for kind in KINDS])
        assert all(t for t in texts), texts
        assert (served(sick), served(well)) == (before[0], before[1] + len(KINDS))
    finally:
        scheduler.resume()
    until(lambda: router.sees_healthy(sick), 15)  # back in rotation on its first 200

    # A host that dies: its frontend killed outright, `subway serve` stops the rest.
    sick.child("frontend").kill()
    assert sick.proc.wait(30) != 0
    until(lambda: router.sees_unhealthy(sick), 15)
    before_well = served(well)
    texts = _send(router.url, [(kind, f"{kind} after one host died") for kind in KINDS * 2])
    assert all(t for t in texts), texts
    assert served(well) == before_well + 2 * len(KINDS)
    assert router.proc.poll() is None
