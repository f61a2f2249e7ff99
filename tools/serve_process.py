"""`subway serve` as a subprocess, for tests and benchmarks: started on a free port with a
run id of its own, waited for until /health answers, its processes looked at, stopped,
and whatever it left behind removed.

Benchmark clients import this module: it must not import torch.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import psutil

from subway.tools.proc_title import parse

LOG_TAIL = 8000  # characters of the log that a failed start's error carries


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (IPv6 where it has a colon) at the time of asking, picked
    at random below the kernel's ephemeral range: a port the kernel hands out (bind to 0)
    is one that any process's next outgoing connection may take as its source port before
    the caller binds it (a test server once failed to start on "Address already in use").
    Another process may still take it, rarely; then the kernel's choice."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10_000, low)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), else IANA's 49152."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
    return low if low > 10_001 else 49152


def health(url: str) -> int:
    """/health's status; 0 if nothing answers (refused, reset), -1 if it does not in 2 s."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TimeoutException:
        return -1
    except httpx.HTTPError:
        return 0


def ready(url: str, whole: bool = False) -> bool:
    """Whether /health answers 200 and, for `whole`, its JSON "status" is "ok": every
    engine serves, not only some of them ("degraded")."""
    try:
        r = httpx.get(url + "/health", timeout=1)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    return not whole or not r.content or r.json().get("status") == "ok"


def log_tail(path: str | None, chars: int = LOG_TAIL) -> str:
    """The last `chars` characters of the log at `path` ("" if there is none)."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    within_s: float,
    whole: bool = False,
    log: str | None = None,
    label: str = "serve",
) -> None:
    """Until `url` is `ready` (`whole`: every engine). RuntimeError with the tail of `log`
    if `proc` exits first or `within_s` passes; stopping `proc` is the caller's part."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{label} exited early ({proc.returncode}); log {log}:\n{log_tail(log)}"
            )
        if ready(url, whole):
            return
        time.sleep(0.2)  # the bounded readiness poll: /health is all there is to wait on
    raise RuntimeError(
        f"{label} did not become healthy within {within_s:.0f} s; log {log}:\n{log_tail(log)}"
    )


def engine_processes(serve_pid: int) -> dict[str, psutil.Process]:
    """serve's children by role: "frontend", "scheduler", "worker 0", "worker 1", ..."""
    out: dict[str, psutil.Process] = {}
    try:
        children = psutil.Process(serve_pid).children(recursive=False)
    except psutil.NoSuchProcess:
        return out
    for c in children:
        try:
            cmd = c.cmdline()
        except psutil.Error:
            continue
        what = parse(cmd)
        kind = what.get("kind", "?")
        if kind == "worker":
            kind = f"worker {what.get('rank', '0')}"
        out[kind] = c
    return out


class ServeProcess:
    """`subway serve` as a subprocess on a free port, with a run id of its own (`prefix`
    and 8 hex digits), logging to a temporary file; healthy once constructed; as a context
    manager, stopped on leaving the block.

    `model` "" means the default model; `flags` are more `serve` flags; `whole`: wait
    until every engine serves (`/health` "ok"), not only one ("degraded"): a test of
    routing between engines must not start before all are up. A start that fails or is
    interrupted (Ctrl-C included) kills whatever it started before raising."""

    def __init__(
        self,
        model: str = "",
        *flags: str,
        startup_timeout: float = 300.0,
        whole: bool = False,
        prefix: str = "serve",
    ) -> None:
        self.whole = whole
        self.port = free_port()
        self.run_id = prefix + uuid.uuid4().hex[:8]
        self.run_dir = os.path.join(tempfile.gettempdir(), f"subway-{self.run_id}")
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--port", str(self.port)]
        cmd += ["--run-id", self.run_id, "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        if model:
            cmd += ["--model", model]
        self.log = tempfile.NamedTemporaryFile(prefix="subway-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*cmd, *flags], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc, startup_timeout, whole, self.log.name)
        except BaseException:  # leave no engine behind, whatever stopped the start
            self.kill_all()
            raise

    # ------------------------------------------------------------ looking at it

    def healthy(self) -> bool:
        """Whether /health answers 200 (and "ok", for a `whole` server) now."""
        return ready(self.url, self.whole)

    def output(self) -> str:
        """Everything serve and its processes wrote so far."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def children(self) -> list[psutil.Process]:
        """serve's direct children (frontend, schedulers, workers); none once it is gone."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []

    def child(self, kind: str) -> psutil.Process:
        """The first child whose title names `kind` ("frontend", "scheduler", "worker")."""
        for c in self.children():
            if parse(c.cmdline()).get("kind") == kind:
                return c
        raise LookupError(kind)

    def processes(self) -> dict[str, psutil.Process]:
        """serve's children by role, as `engine_processes` names them."""
        return engine_processes(self.proc.pid)

    def shm_files(self) -> list[str]:
        """Names in /dev/shm that carry this run id."""
        return [f for f in os.listdir("/dev/shm") if self.run_id in f]

    def leftovers(self) -> list[str]:
        """Paths of whatever of this run id is still in /dev/shm or the run folder."""
        left = [os.path.join("/dev/shm", f) for f in self.shm_files()]
        if os.path.exists(self.run_dir):
            inside = [os.path.join(self.run_dir, f) for f in os.listdir(self.run_dir)]
            left += inside or [self.run_dir]
        return left

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {sample name: value}, summed over their labels."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    # ------------------------------------------------------------ ending it

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """`with ServeProcess(...) as s:` stops it however the block ends: a script that
        raised once left its servers running (one of ours did, for an hour)."""
        self.stop()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send `sig` and return serve's exit code; None if it did not exit within
        `timeout` (then everything it started is killed and its leftovers removed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return None

    def kill_all(self, clean: bool = True) -> None:
        """SIGKILL serve and every process under it (ours, by pid), then (`clean`) remove
        what is left of the run id."""
        try:
            root = psutil.Process(self.proc.pid)
            below = root.children(recursive=True)
            first = [root, *root.children()]
        except psutil.NoSuchProcess:
            below, first = [], []
        # serve and its children first; their resource trackers then unlink the shm their
        # owners made (as they would after any SIGKILL), and get SIGKILL only if they linger.
        for group in (first, [p for p in below if p not in first]):
            if group is not first:
                psutil.wait_procs(group, timeout=5)
            for p in group:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(group, timeout=10)
        self.proc.wait()
        if clean:
            self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """Unlink this run id's shm files and remove its run folder (named by us, from the
        run id) with whatever is in it."""
        for f in self.shm_files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", f))
        shutil.rmtree(self.run_dir, ignore_errors=True)
