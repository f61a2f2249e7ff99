"""Start and stop a real `subway serve` for tests: every process, real sockets, real HTTP."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from subway.tools.serve_process import ServeProcess, free_port

__all__ = [
    "DEFAULT_FLAGS",
    "KV_BLOCKS",
    "TINY_FLAGS",
    "Server",
    "ServerPool",
    "complete",
    "degraded",
    "free_port",
    "per_engine",
    "until",
]


def until(cond, within: float) -> float:
    """Seconds until `cond()` held; fails past `within`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within, f"not within {within} s"
        time.sleep(0.02)  # paces the poll of an outside condition
    return time.monotonic() - t0


def degraded(url: str) -> bool:
    """Whether `/health` says 200 "degraded": some engine lost, the rest serving."""
    r = httpx.get(url + "/health", timeout=2)
    return r.status_code == 200 and r.json()["status"] == "degraded"


class Server(ServeProcess):
    """A test's `subway serve` (subway.tools.serve_process): run id "t...", 180 s to start."""

    def __init__(
        self, model: str, *flags: str, startup_timeout: float = 180.0, whole: bool = False
    ) -> None:
        super().__init__(model, *flags, startup_timeout=startup_timeout, whole=whole, prefix="t")

    def read_output(self) -> str:
        return self.output()


# The flags of the shared servers (`ServerPool`) that more than one module asks for.
# A pool of 1024 blocks (16,384 tokens) where a test needs no more: sizing the pool from
# memory commits gigabytes and costs about a second of every start.
KV_BLOCKS = ("--num-kv-blocks", "1024")
TINY_FLAGS = ("--served-model-name", "tiny", "--max-model-len", "2048", "--template-timeout", "120",
              *KV_BLOCKS)  # fmt: skip
DEFAULT_FLAGS = ("--served-model-name", "m", "--max-model-len", "2048")


class ServerPool:
    """Live servers shared by the whole test session, one per (model, flags): a module asks
    for the server it needs (`servers.get(model, *flags)`, the `servers` fixture) and gets
    the one an earlier module started with the same flags, still running and healthy, or a
    new one. At most `keep` run at once: past that, the one asked for least recently stops.

    Only for servers a module uses as any client would: a module that kills, stops or
    reconfigures its server starts its own `Server`.
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.started = 0
        self._live: dict[tuple[str, tuple[str, ...]], Server] = {}

    def get(self, model: str, *flags: str) -> Server:
        key = (model, flags)
        server = self._live.pop(key, None)
        if server is not None and not (server.proc.poll() is None and server.healthy()):
            server.stop()  # a module left it broken: the next one gets a new one
            server = None
        if server is None:
            while len(self._live) >= self.keep:
                self._live.pop(next(iter(self._live))).stop()
            server = Server(model, *flags)
            self.started += 1
        self._live[key] = server  # the most recently asked for goes last
        return server

    def stop_all(self) -> None:
        while self._live:
            self._live.popitem()[1].stop()


def per_engine(url: str, name: str) -> dict[str, float]:
    """{engine label: value} of one metric family (summed over its other labels)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == name and "engine" in s.labels:
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def complete(url: str, ids: list[int], n: int) -> str:
    """Greedy text for a prompt of token ids, exactly `n` tokens, with its usage checked."""
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n,
                             "total_tokens": len(ids) + n}  # fmt: skip
    return body["choices"][0]["text"]
