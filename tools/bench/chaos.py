"""Chaos test: faults injected into a loaded `subway serve`, one case per fresh server.

Each case starts `subway serve` (the default model unless `--model`), puts a few streaming
clients on it (`--clients`, `ignore_eos`, `--max-tokens` each), waits until every client
has tokens flowing, then injects one fault:

- `kill-<proc>`: SIGKILL one process; `stop-<proc>`: SIGSTOP it (a hang). <proc> is
  `frontend`, `scheduler`, `worker0`, or `worker1` (a tensor-parallel rank > 0; that
  server runs with -tp 2). Expected: the survivors report it (a client's request ends
  with an error or /health leaves 200), `serve` exits non-zero, every process of the
  engine is gone, all within `--bound` seconds.
- `probe`, `probe-junk`: the server's four internal sockets on tcp://127.0.0.1 ports;
  open a plain TCP connection to each and close it (`probe-junk` writes 64 random bytes
  first). Expected: /health stays 200, every stream runs to its length (in flight at the
  probe and one more per client after it), then SIGTERM stops `serve` with exit 0.

After each case /dev/shm and the run folder must hold nothing of the run id. A table
says, for each case: the first sign of detection (seconds after the fault), serve's exit
(seconds and code), the clients' requests (ok / error / hung), leftovers, PASS/FAIL;
the exit status is 1 if any case failed. In notes, a /health of -1 means no answer
within 2 s, 0 a refused connection.

`--step-timeout` is passed to serve only when above 0; 0 (the default) leaves serve its
own bound on a hung step (adaptive since issue 43: max(10 s, 20 x the step's predicted
time)), under which a stopped worker (`stop-worker0`, `stop-worker1`) passes only if it
was detected within `STOPPED_WORKER_S` (30 s).

    python -m subway.tools.bench.chaos                     # every case, serve's defaults
    python -m subway.tools.bench.chaos --case kill-worker0 --case probe
    python -m subway.tools.bench.chaos --step-timeout 5    # a fixed bound instead
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time

import httpx
import psutil

from subway.tools.bench.soak import ServeProcess, engine_processes, free_port, health

PROCS = {"frontend": "frontend", "scheduler": "scheduler", "worker0": "worker 0",
         "worker1": "worker 1"}  # fmt: skip
CASES = [f"{f}-{p}" for f in ("kill", "stop") for p in PROCS] + ["probe", "probe-junk"]
PROMPT = "Write a long story about a subway train that runs all night through the city."
STOPPED_WORKER_S = 30.0  # under serve's default bound, a stopped worker is detected this soon


@dataclasses.dataclass
class Stream:
    """One streamed request of the load."""

    start: float
    end: float = 0.0
    tokens_seen: int = 0  # chunks with text so far
    completion_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False  # [DONE] arrived
    error: str = ""

    @property
    def ok(self) -> bool:
        """Ran to its end: [DONE], no error, a finish_reason other than "abort"/"error"."""
        return self.done and not self.error and self.finish_reason not in (None, "abort", "error")


class Load:
    """`clients` threads, each streaming one request after another until `finish` is called;
    then each finishes its current request and `more` further ones, and stops."""

    def __init__(self, url: str, clients: int, max_tokens: int, timeout: float) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.timeout = httpx.Timeout(timeout, connect=5.0)
        self.streams: list[list[Stream]] = [[] for _ in range(clients)]
        self._more: int | None = None
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def flowing(self) -> bool:
        """Every client has a request in flight that has had a token."""
        return all(s and not s[-1].end and s[-1].tokens_seen > 0 for s in self.streams)

    def finish(self, more: int) -> None:
        self._more = more

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _client(self, i: int) -> None:
        body = {
            "prompt": PROMPT,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        left = None
        with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
            while left is None or left >= 0:
                s = Stream(start=time.monotonic())
                self.streams[i].append(s)
                self._one(client, body, s)
                s.end = time.monotonic()
                if left is None and self._more is not None:
                    left = self._more
                left = None if left is None else left - 1
                if s.error and left is None and self._more is None:
                    time.sleep(0.05)  # a refused request before any fault: do not spin

    @staticmethod
    def _one(client: httpx.Client, body: dict, s: Stream) -> None:
        try:
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    s.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        s.done = True
                        break
                    msg = json.loads(data)
                    if msg.get("error"):
                        s.error = "error event: " + str(msg["error"].get("message", ""))[:80]
                        return
                    if msg.get("usage"):
                        s.completion_tokens = msg["usage"]["completion_tokens"]
                    for c in msg.get("choices") or ():
                        s.finish_reason = c.get("finish_reason") or s.finish_reason
                        s.tokens_seen += bool(c.get("text"))
            if not s.done:
                s.error = "stream ended without [DONE]"
        except httpx.TimeoutException:
            s.error = "hung (client timeout)"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            s.error = type(e).__name__


@dataclasses.dataclass
class Result:
    case: str
    fault: str
    process: str
    detect_s: float | None = None  # first sign: a client's error, a /health 503, serve's exit
    clients_s: float | None = None  # the last in-flight request's end
    exit_s: float | None = None
    exit_code: int | None = None
    clients: str = ""
    leftovers: list[str] = dataclasses.field(default_factory=list)
    passed: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)


def tcp_flags() -> tuple[list[str], list[int]]:
    ports = [free_port() for _ in range(4)]
    names = ("--scheduler-addr", "--frontend-addr", "--plan-addr", "--result-addr")
    flags = [x for n, p in zip(names, ports, strict=True) for x in (n, f"tcp://127.0.0.1:{p}")]
    return flags, ports


def wait_for(cond, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)  # polling a condition under a deadline
    return cond()


def all_pids(server: ServeProcess) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def run_case(case: str, a: argparse.Namespace) -> Result:
    fault, _, proc = case.partition("-")
    flags = list(a.serve_args)
    if a.step_timeout > 0:
        flags += ["--step-timeout", str(a.step_timeout)]
    ports: list[int] = []
    if fault == "probe":
        tcp, ports = tcp_flags()
        flags += tcp
    if proc == "worker1":
        flags += ["-tp", "2"]
    res = Result(case, fault, PROCS.get(proc, "tcp ports"))
    server = ServeProcess(a.model, *flags)
    try:
        load = Load(server.url, a.clients, a.max_tokens, timeout=a.bound)
        if not wait_for(load.flowing, a.bound):
            res.notes.append("load never flowed")
            return res
        pids = all_pids(server)
        health_log: list[tuple[float, int]] = []
        t0 = time.monotonic()
        if fault == "probe":
            inject_probes(ports, junk=proc == "junk")
            load.finish(more=1)
        else:
            target = engine_processes(server.proc.pid)[PROCS[proc]]
            os.kill(target.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            load.finish(more=0)
        watch(server, load, t0, a.bound, health_log, res, fault)
        stopped_worker = fault == "stop" and proc.startswith("worker")
        within = STOPPED_WORKER_S if stopped_worker and a.step_timeout <= 0 else None
        judge(server, load, t0, pids, health_log, res, a.bound, detect_within=within)
        load.join(5)
        return res
    finally:
        if server.proc.poll() is None or alive(all_pids(server)):
            server.kill_all()


def inject_probes(ports: list[int], junk: bool) -> None:
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            if junk:
                s.sendall(os.urandom(64))


def watch(server, load, t0, bound, health_log, res: Result, fault: str) -> None:
    """Until serve exits and the clients are done (faults), or the clients are done (probes),
    or `bound` seconds: log /health and the serve exit."""
    deadline = t0 + bound
    while time.monotonic() < deadline:
        code = health(server.url) if server.proc.poll() is None else 0
        health_log.append((time.monotonic() - t0, code))
        rc = server.proc.poll()
        if rc is not None and res.exit_s is None:
            res.exit_s, res.exit_code = time.monotonic() - t0, rc
        clients_done = not any(t.is_alive() for t in load._threads)
        if clients_done and (fault == "probe" or rc is not None):
            return
        time.sleep(0.1)  # polling under a deadline


def judge(
    server, load, t0, pids, health_log, res: Result, bound: float,
    detect_within: float | None = None,
) -> None:  # fmt: skip
    """`detect_within`: a fault case fails unless detected within this many seconds."""
    after = [s for streams in load.streams for s in streams if s.end == 0 or s.end >= t0]
    hung = [s for s in after if s.end == 0 or "hung" in s.error]
    errs = [s for s in after if not s.ok and s not in hung]  # an error, or finish "abort"
    ok = [s for s in after if s.ok]
    res.clients = f"{len(ok)} ok / {len(errs)} err / {len(hung)} hung"
    first_err = min((s.end - t0 for s in errs), default=None)
    # A survivor's report: an answer other than 200 (a frontend that does not answer in time
    # is hung, and says nothing; one that refuses is gone, which the clients see too).
    first_503 = next((t for t, c in health_log if c >= 300), None)
    signs = [t for t in (first_err, first_503, res.exit_s) if t is not None]
    res.detect_s = min(signs) if signs else None
    res.clients_s = max((s.end - t0 for s in after if s.end), default=None)
    if res.fault == "probe":
        long_ok = all(s.completion_tokens == load.max_tokens and s.finish_reason == "length"
                      for s in after)  # fmt: skip
        off = [(t, c) for t, c in health_log if c != 200]
        if off:
            res.notes.append(f"/health {off[0][1]} at {off[0][0]:.1f} s ({len(off)} polls not 200)")
        if errs or hung or not long_ok:
            kinds = sorted({s.error or f"{s.finish_reason}/{s.completion_tokens}" for s in after
                            if not s.ok or s.completion_tokens != load.max_tokens})  # fmt: skip
            res.notes.append("streams cut: " + ", ".join(kinds))
        alive_then = server.proc.poll() is None
        if not alive_then:
            res.notes.append(f"serve exited ({server.proc.returncode})")
        t_stop = time.monotonic()
        rc = server.stop(timeout=bound)
        res.exit_code, res.exit_s = rc, None if rc is None else time.monotonic() - t_stop
        healthy = not off and not errs and not hung and long_ok and alive_then
        res.passed = healthy and rc == 0
        if rc != 0:
            res.notes.append(f"SIGTERM afterwards: exit {rc}")
    else:
        if res.exit_s is None:
            res.notes.append(f"serve still running after {bound:.0f} s")
        elif res.exit_code == 0:
            res.notes.append("serve exited 0")
        if hung:
            res.notes.append(f"{len(hung)} client requests hung")
        if res.detect_s is None:
            res.notes.append("no survivor reported it")
        if errs:
            kinds = {s.error or f"finish_reason {s.finish_reason}" for s in errs}
            res.notes.append("client errors: " + ", ".join(sorted(kinds)))
        stragglers = alive(pids) if res.exit_s is not None else []
        if res.exit_s is not None and stragglers:
            wait_for(lambda: not alive(pids), 5)
            if alive(pids):
                res.notes.append(f"processes left running: {alive(pids)}")
        late = (
            detect_within is not None and res.detect_s is not None
            and res.detect_s > detect_within
        )  # fmt: skip
        if late:
            res.notes.append(f"detected after {res.detect_s:.1f} s, over {detect_within:g} s")
        res.passed = (
            res.exit_s is not None and res.exit_code not in (0, None) and not hung
            and res.detect_s is not None and not alive(pids) and not late
        )  # fmt: skip
    forced = server.proc.poll() is None
    if forced:
        server.kill_all(clean=False)
        res.notes.append("serve and its children SIGKILLed by chaos")
    # An owner's resource tracker unlinks its shm just after the owner dies: allow it a moment.
    wait_for(lambda: not server.leftovers(), 5)
    res.leftovers = server.leftovers()
    res.passed = res.passed and not res.leftovers
    if res.leftovers:
        where = " after the forced kill" if forced else ""
        res.notes.append(f"left{where}: " + " ".join(os.path.basename(f) for f in res.leftovers))
    server.remove_leftovers()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: list[Result]) -> str:
    head = f"{'case':<15}{'process':<11}{'detect s':>9}{'clients s':>10}{'exit s (code)':>15}  "
    head += f"{'clients':<24}"
    lines = [head + f"{'leftovers':<11}result  notes"]
    for r in results:
        ex = f"{fmt(r.exit_s)} ({'-' if r.exit_code is None else r.exit_code})"
        left = str(len(r.leftovers)) if r.leftovers else "none"
        lines.append(
            f"{r.case:<15}{r.process:<11}{fmt(r.detect_s):>9}{fmt(r.clients_s):>10}{ex:>15}  "
            f"{r.clients:<24}"
            f"{left:<11}{'PASS' if r.passed else 'FAIL':<8}{'; '.join(r.notes)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--case", action="append", choices=CASES, help="a case (repeatable; default all)"
    )
    p.add_argument("--model", default="", help="model to serve (default: the default model)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed request")
    p.add_argument("--bound", type=float, default=60.0, help="seconds for detection and exit")
    p.add_argument(
        "--step-timeout", type=float, default=0.0,
        help="serve's --step-timeout; 0: serve's own default (a stopped worker must then be "
        f"detected within {STOPPED_WORKER_S:g} s)",
    )  # fmt: skip
    p.add_argument("--out", default="", help="write the results as JSON here")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.serve_args = argv[cut + 1 :]  # more serve flags, after --
    results = []
    for case in a.case or CASES:
        t = time.monotonic()
        try:
            r = run_case(case, a)
        except RuntimeError as e:  # the server did not start
            r = Result(case, case.partition("-")[0], "-", notes=[str(e).splitlines()[0]])
        print(f"chaos: {time.monotonic() - t:.0f} s: {table([r]).splitlines()[1]}", flush=True)
        results.append(r)
    print(table(results))
    if a.out:
        with open(a.out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
