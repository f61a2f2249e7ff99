"""A whole engine on its worst day: a hung worker, SIGTERM to every process at once, a
frontend restarted under running workers, port probes on every internal tcp port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from reference import hf_greedy
from serving import Server, free_port, until


class Streams:
    """`n` streaming completions in threads; each one's SSE lines or its exception."""

    def __init__(self, url: str, n: int, max_tokens: int, prompt: str = "load ") -> None:
        self.results: list[object] = [None] * n
        self.threads = [
            threading.Thread(target=self._one, args=(url, i, max_tokens, prompt)) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _one(self, url: str, i: int, max_tokens: int, prompt: str) -> None:
        body = {"prompt": f"{prompt}{i} " * 6, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                self.results[i] = list(r.iter_lines())
        except httpx.HTTPError as e:
            self.results[i] = e

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request hung"

    @staticmethod
    def summary(lines: object) -> tuple[str | None, int]:
        """(last finish_reason, completion tokens) of one stream; (error, 0) for a failure."""
        if not isinstance(lines, list):
            return "exception", 0
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        if any("error" in e for e in events):
            return "error", 0
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])]
        usage = [e["usage"] for e in events if e.get("usage")]
        return (reasons[-1] if reasons else None), (usage[-1]["completion_tokens"] if usage else 0)


def _running(server: Server) -> float:
    return server.metrics().get("subway:num_requests_running", 0)


def test_a_stopped_worker_is_detected_and_serve_exits_non_zero(tiny_models):
    s = Server(tiny_models["llama"], "--step-timeout", "3", "--num-kv-blocks", "256",
               "--max-model-len", "2048")  # fmt: skip
    pids = [c.pid for c in s.children()]
    try:
        streams = Streams(s.url, 2, 1900)
        until(lambda: _running(s) >= 1, 30)
        worker = s.child("worker")
        worker.suspend()  # SIGSTOP
        t0 = time.monotonic()
        streams.join(30)
        took = time.monotonic() - t0
        assert all(Streams.summary(r)[0] in ("error", "exception") for r in streams.results)
        assert took < 3 + 10, took  # the step timeout, plus the time to say so
        assert s.proc.wait(30) != 0
        log = s.read_output()
        assert "hung" in log and "step-timeout" in log
    finally:
        for p in pids:
            if psutil.pid_exists(p):
                psutil.Process(p).kill()
        s.stop()
    assert until(lambda: not s.shm_files(), 5) < 5


@pytest.mark.slow
def test_sigterm_to_every_process_at_once_still_drains(tiny_models):
    """systemd's default (KillMode=control-group): SIGTERM reaches the launcher, frontend,
    scheduler and workers together. Nothing in flight may end with an error."""
    s = Server(tiny_models["llama"], "--shutdown-timeout", "60", "--num-kv-blocks", "256",
               "--max-model-len", "2048")  # fmt: skip
    streams = Streams(s.url, 3, 120)
    until(lambda: _running(s) >= 3, 30)
    for p in [s.proc.pid, *(c.pid for c in s.children())]:
        os.kill(p, signal.SIGTERM)
    streams.join(90)
    got = [Streams.summary(r) for r in streams.results]
    assert got == [("length", 120)] * 3, (streams.results, s.read_output()[-3000:])
    assert s.proc.wait(60) == 0
    assert until(lambda: not s.shm_files(), 5) < 5


def _one_by_one(model: str, run_id: str, http: int) -> tuple[list[str], list[subprocess.Popen]]:
    flags = ["--model", model, "--run-id", run_id, "--port", str(http), "--num-kv-blocks", "128",
             "--dist-init-addr", f"127.0.0.1:{free_port()}"]  # fmt: skip
    cli = [sys.executable, "-m", "subway.tools.cli"]
    procs = [subprocess.Popen([*cli, "scheduler", *flags]),
             subprocess.Popen([*cli, "worker", "--rank", "0", *flags])]  # fmt: skip
    return [*cli, "frontend", *flags], procs


def _wait_healthy(url: str, procs: list[subprocess.Popen]) -> None:
    def healthy() -> bool:
        assert all(p.poll() is None for p in procs)
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    until(healthy, 120)


@pytest.mark.slow
def test_workers_reattach_to_a_restarted_frontends_prompts(tiny_models):
    """Per-process mode: a new frontend makes a new prompt buffer; the workers must read
    prompts from it (not from the old, unlinked segment they still map)."""
    from transformers import AutoTokenizer

    model = tiny_models["llama"]
    http = free_port()
    url = f"http://127.0.0.1:{http}"
    run_id = f"re{http}"
    frontend_cmd, procs = _one_by_one(model, run_id, http)
    frontend = subprocess.Popen(frontend_cmd)
    tok = AutoTokenizer.from_pretrained(model)

    def complete(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        _wait_healthy(url, [*procs, frontend])
        complete("the first frontend wrote this prompt at the start of its ring")
        frontend.send_signal(signal.SIGTERM)
        assert frontend.wait(30) == 0
        frontend = subprocess.Popen(frontend_cmd)
        _wait_healthy(url, [*procs, frontend])
        prompt = "a different prompt"
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert complete(prompt) == tok.decode(hf_greedy(model, ids, 8).tokens)
    finally:
        for p in [frontend, *procs]:
            p.send_signal(signal.SIGTERM)
        for p in [frontend, *procs]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert until(lambda: not [f for f in os.listdir("/dev/shm") if run_id in f], 5) < 5


@pytest.mark.slow
def test_port_probes_on_every_internal_port_disturb_nothing(tiny_models):
    """A port scanner or a load balancer's health probe connects and closes at once."""
    ports = {name: free_port() for name in ("scheduler", "frontend", "plan", "result")}
    flags = [f for name, port in ports.items()
             for f in (f"--{name}-addr", f"tcp://127.0.0.1:{port}")]  # fmt: skip
    s = Server(tiny_models["llama"], *flags, "--num-kv-blocks", "256", "--max-model-len", "2048")
    try:
        streams = Streams(s.url, 2, 150)
        until(lambda: _running(s) >= 2, 30)
        for _ in range(3):
            for port in ports.values():
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    pass  # connect, and close at once
                with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                    c.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not ZMTP at all
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        streams.join(90)
        assert [Streams.summary(r) for r in streams.results] == [("length", 150)] * 2
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    finally:
        assert s.stop() == 0
    assert s.shm_files() == []


@pytest.mark.parametrize("kind", ["scheduler", "worker", "frontend"])
def test_processes_started_alone_need_a_run_id(kind):
    """Started one by one, every process of one engine must be given the same --run-id:
    a shared default would let two engines on one host meet each other's sockets."""
    cmd = [sys.executable, "-m", "subway.tools.cli", kind, "--model", "/nonexistent"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--run-id" in r.stderr
