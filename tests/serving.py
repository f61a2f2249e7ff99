"""Start and stop a real `subway serve` for tests: every process, real sockets, real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from subway.tools.proc_title import parse


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `subway serve` subprocess on a free port with its own run id."""

    def __init__(
        self, model: str, *flags: str, startup_timeout: float = 180.0, whole: bool = False
    ) -> None:
        """`whole`: wait until every engine serves (`/health` "ok"), not only one of them
        ("degraded": a test of routing between engines must not start before all are up)."""
        self.whole = whole
        self.port = free_port()
        self.run_id = "t" + uuid.uuid4().hex[:8]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--port", str(self.port)]
        cmd += ["--run-id", self.run_id, "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        if model:
            cmd += ["--model", model]
        self.log = tempfile.NamedTemporaryFile(prefix="subway-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*cmd, *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.read_output()}")
            if self.healthy():
                return
            time.sleep(0.2)  # a bounded wait for readiness, not synchronisation
        self.stop()
        raise RuntimeError(f"serve did not become healthy:\n{self.read_output()}")

    def healthy(self) -> bool:
        try:
            r = httpx.get(self.url + "/health", timeout=1)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        return not self.whole or not r.content or r.json().get("status") == "ok"

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []

    def child(self, kind: str) -> psutil.Process:
        for c in self.children():
            if parse(c.cmdline()).get("kind") == kind:
                return c
        raise LookupError(kind)

    def shm_files(self) -> list[str]:
        return [f for f in os.listdir("/dev/shm") if self.run_id in f]

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {name{labels}: value}, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def read_output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for c in self.children():
                c.kill()
            self.proc.kill()
            return self.proc.wait()


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
