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

- `kill-prefill`, `stop-prefill`, `kill-decode`, `stop-decode` (serve with
  `--prefill-engines 1 --decode-engines 1`): the named engine's worker, mid-handoff (at
  the moment a stream has its first token, which the prefill engine sampled, so its KV
  lease is live and the decode engine is copying it). Expected: the engine is reported
  (/health "degraded", or a client's error), that engine's processes are gone, `serve`
  runs on, and a round of new requests afterwards (one per client) all run to their
  length on the engine left; then SIGTERM stops `serve` with exit 0.
- `stop-grammar`: SIGSTOP worker 0 while it compiles a grammar (a schema that takes it
  seconds, sent once the load flows; the fault lands when a thread new to worker 0 has
  spent 0.2 s of CPU). Expected as for `stop-worker0`, and the constrained request ends
  with an error, not a hang.

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

from subway.tools.bench.soak import ServeProcess, engine_processes, free_port
from subway.tools.proc_title import parse as parse_title

PROCS = {"frontend": "frontend", "scheduler": "scheduler", "worker0": "worker 0",
         "worker1": "worker 1"}  # fmt: skip
ROLES = {"prefill": "prefill engine", "decode": "decode engine"}
CASES = [f"{f}-{p}" for f in ("kill", "stop") for p in (*PROCS, *ROLES)]
CASES += ["stop-grammar", "probe", "probe-junk"]
DISAGG = ["--prefill-engines", "1", "--decode-engines", "1"]
COMPILE_CPU_S = 0.2  # a new thread of worker 0 with this much CPU is compiling the grammar
PROMPT = "Write a long story about a subway train that runs all night through the city."
STOPPED_WORKER_S = 30.0  # under serve's default bound, a stopped worker is detected this soon


@dataclasses.dataclass
class Stream:
    """One streamed request of the load."""

    start: float
    end: float = 0.0
    tokens_seen: int = 0  # chunks with text so far
    first_token: float = 0.0  # when the first chunk with text came
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

    def handing_off(self) -> bool:
        """Some stream has just had its first token (the prefill engine's) and no second."""
        return any(s and not s[-1].end and s[-1].tokens_seen == 1 for s in self.streams)

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
                        if c.get("text"):
                            s.tokens_seen += 1
                            s.first_token = s.first_token or time.monotonic()
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
    if proc in ROLES:
        flags += DISAGG
    what = "worker 0" if proc == "grammar" else PROCS.get(proc) or ROLES.get(proc, "tcp ports")
    res = Result(case, fault, what)
    server = ServeProcess(a.model, *flags)
    try:
        if proc in ROLES and not wait_for(lambda: health_status(server.url)[1] == "ok", a.bound):
            res.notes.append("the engines were never all ready")
            return res
        load = Load(server.url, a.clients, a.max_tokens, timeout=a.bound)
        if not wait_for(load.flowing, a.bound):
            res.notes.append("load never flowed")
            return res
        pids = all_pids(server)
        health_log: list[tuple[float, int]] = []
        sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        constrained: list[Stream] = []
        if fault == "probe":
            t0 = time.monotonic()
            inject_probes(ports, junk=proc == "junk")
            load.finish(more=1)
        elif proc in ROLES:
            target = engine_of(server.proc.pid, proc)
            pids = [p.pid for p in target]
            if not wait_for(load.handing_off, a.bound, every=0.002):
                res.notes.append("no handoff seen")
                return res
            t0 = time.monotonic()
            os.kill(next(p for p in target if parse_title(p.cmdline())["kind"] == "worker").pid,
                    sig)  # fmt: skip
            load.finish(more=0)
        elif proc == "grammar":
            worker = engine_processes(server.proc.pid)["worker 0"]
            before = thread_cpu(worker)
            time.sleep(1.0)  # a window in which the threads that serve steps show themselves
            mid = thread_cpu(worker)
            idle = {t for t, c in mid.items() if c - before.get(t, 0.0) < 0.01}
            constrained = send_constrained(server.url, a.bound)
            if not wait_for(lambda: compiling(worker, mid, idle), a.bound, every=0.01):
                res.notes.append("worker 0 never compiled")
                return res
            t0 = time.monotonic()
            os.kill(worker.pid, sig)
            load.finish(more=0)
        else:
            t0 = time.monotonic()
            os.kill(engine_processes(server.proc.pid)[PROCS[proc]].pid, sig)
            load.finish(more=0)
        watch(server, load, t0, a.bound, health_log, res, fault, engine=proc in ROLES)
        stopped_worker = fault == "stop"  # every stop case stops a worker but the frontend's
        stopped_worker = stopped_worker and proc not in ("frontend", "scheduler")
        within = STOPPED_WORKER_S if stopped_worker and a.step_timeout <= 0 else None
        if proc in ROLES:
            judge_engine(server, load, t0, pids, health_log, res, a, within)
        else:
            judge(server, load, t0, pids, health_log, res, a.bound, detect_within=within,
                  constrained=constrained)  # fmt: skip
        load.join(5)
        return res
    finally:
        if server.proc.poll() is None or alive(all_pids(server)):
            server.kill_all()


def engine_of(serve_pid: int, role: str) -> list[psutil.Process]:
    """The processes (scheduler, workers) of serve's engine with this role."""
    out = []
    for c in psutil.Process(serve_pid).children(recursive=False):
        try:
            what = parse_title(c.cmdline())
        except psutil.Error:
            continue
        if what.get("role") == role:
            out.append(c)
    return out


def thread_cpu(p: psutil.Process) -> dict[int, float]:
    """Each thread's CPU seconds so far."""
    try:
        return {t.id: t.user_time + t.system_time for t in p.threads()}
    except psutil.Error:
        return {}


def compiling(worker: psutil.Process, mid: dict[int, float], idle: set[int]) -> bool:
    """A thread that was idle while steps ran (`idle`, CPU times `mid`), or is new, has
    spent COMPILE_CPU_S since: the grammar's compile (xgrammar's own threads or ours)."""
    return any(
        (t in idle or t not in mid) and c - mid.get(t, 0.0) >= COMPILE_CPU_S
        for t, c in thread_cpu(worker).items()
    )


def slow_schema(salt: int) -> dict:
    """A JSON schema that xgrammar takes seconds to compile (200 patterned strings), new
    to the server (distinct per `salt`)."""
    props = {
        f"p{i}_{salt}": {"type": "string", "pattern": f"[a-z]{{1,5}}[0-9]{{0,{3 + salt}}}"}
        for i in range(200)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def send_constrained(url: str, timeout: float) -> list[Stream]:
    """One streamed request with a slow schema, in a thread; its Stream in the list."""
    s = Stream(start=time.monotonic())
    body = {
        "prompt": "Give JSON", "max_tokens": 8, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "slow", "schema": slow_schema(int(time.time()) % 1000)}},
    }  # fmt: skip

    def run() -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout, connect=5.0)) as c:
            Load._one(c, body, s)
        s.end = time.monotonic()

    threading.Thread(target=run, daemon=True).start()
    return [s]


def health_status(url: str) -> tuple[int, str]:
    """/health's code and its JSON "status" ("" when it has none)."""
    try:
        r = httpx.get(url + "/health", timeout=2)
    except httpx.TimeoutException:
        return -1, ""
    except httpx.HTTPError:
        return 0, ""
    try:
        return r.status_code, str(r.json().get("status", ""))
    except ValueError:
        return r.status_code, ""


def inject_probes(ports: list[int], junk: bool) -> None:
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            if junk:
                s.sendall(os.urandom(64))


def watch(server, load, t0, bound, health_log, res: Result, fault: str, engine: bool = False,
          ) -> None:  # fmt: skip
    """Until serve exits and the clients are done (faults), or the clients are done (probes),
    or the clients are done and /health says "degraded" (an `engine` fault), or `bound`
    seconds: log /health (a "degraded" answer as 299) and the serve exit."""
    deadline = t0 + bound
    while time.monotonic() < deadline:
        code, status = health_status(server.url) if server.proc.poll() is None else (0, "")
        code = 299 if code == 200 and status == "degraded" else code
        health_log.append((time.monotonic() - t0, code))
        rc = server.proc.poll()
        if rc is not None and res.exit_s is None:
            res.exit_s, res.exit_code = time.monotonic() - t0, rc
        clients_done = not any(t.is_alive() for t in load._threads)
        if clients_done and (fault == "probe" or rc is not None or (engine and code == 299)):
            return
        time.sleep(0.1)  # polling under a deadline


def judge(
    server, load, t0, pids, health_log, res: Result, bound: float,
    detect_within: float | None = None, constrained: list[Stream] | None = None,
) -> None:  # fmt: skip
    """`detect_within`: a fault case fails unless detected within this many seconds.
    `constrained`: streams that must end (an error or not) rather than hang."""
    after = [s for streams in load.streams for s in streams if s.end == 0 or s.end >= t0]
    for s in constrained or ():
        wait_for(lambda s=s: s.end > 0, 10)
        if s.end == 0 or "hung" in s.error:
            res.notes.append("the constrained request hung")
            after.append(s)
        else:
            res.notes.append(f"constrained: {s.error or s.finish_reason}")
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
    close_out(server, res)


def close_out(server, res: Result) -> None:
    """Kill what still runs (a note says so), then fail the case on anything of the run left
    in /dev/shm or the run folder, and remove it."""
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


def judge_engine(server, load, t0, pids, health_log, res: Result, a, within) -> None:
    """An engine's worker failed: the engine reported and gone, serve serving on (a new
    round of requests all whole), then a clean SIGTERM; `within` as judge's."""
    after = [s for streams in load.streams for s in streams if s.end == 0 or s.end >= t0]
    hung = [s for s in after if s.end == 0 or "hung" in s.error]
    errs = [s for s in after if not s.ok and s not in hung]
    res.clients = f"{len(after) - len(hung) - len(errs)} ok / {len(errs)} err / {len(hung)} hung"
    first_err = min((s.end - t0 for s in errs), default=None)
    first_sign = next((t for t, c in health_log if c != 200), None)
    signs = [t for t in (first_err, first_sign, res.exit_s) if t is not None]
    res.detect_s = min(signs) if signs else None
    res.clients_s = max((s.end - t0 for s in after if s.end), default=None)
    if errs:
        res.notes.append("client errors: " + ", ".join(sorted({s.error or str(s.finish_reason)
                                                               for s in errs})))  # fmt: skip
    if hung:
        res.notes.append(f"{len(hung)} client requests hung")
    gone = wait_for(lambda: not alive(pids), 10)
    if not gone:
        res.notes.append(f"the engine's processes left running: {alive(pids)}")
    alive_then = server.proc.poll() is None
    fresh_ok = False
    if alive_then:
        again = Load(server.url, a.clients, a.max_tokens, timeout=a.bound)
        again.finish(more=0)
        again.join(a.bound)
        fresh = [s for streams in again.streams for s in streams]
        fresh_ok = bool(fresh) and all(s.ok and s.completion_tokens == a.max_tokens for s in fresh)
        res.notes.append(f"then {sum(s.ok for s in fresh)}/{len(fresh)} new requests whole")
    else:
        res.notes.append(f"serve exited ({server.proc.returncode})")
    late = within is not None and res.detect_s is not None and res.detect_s > within
    if late:
        res.notes.append(f"detected after {res.detect_s:.1f} s, over {within:g} s")
    t_stop = time.monotonic()
    rc = server.stop(timeout=a.bound) if alive_then else server.proc.returncode
    res.exit_code, res.exit_s = rc, None if rc is None else time.monotonic() - t_stop
    if rc != 0:
        res.notes.append(f"SIGTERM afterwards: exit {rc}")
    res.passed = (
        alive_then and fresh_ok and gone and not hung and res.detect_s is not None
        and not late and rc == 0
    )  # fmt: skip
    close_out(server, res)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: list[Result]) -> str:
    head = f"{'case':<15}{'process':<15}{'detect s':>9}{'clients s':>10}{'exit s (code)':>15}  "
    head += f"{'clients':<24}"
    lines = [head + f"{'leftovers':<11}result  notes"]
    for r in results:
        ex = f"{fmt(r.exit_s)} ({'-' if r.exit_code is None else r.exit_code})"
        left = str(len(r.leftovers)) if r.leftovers else "none"
        lines.append(
            f"{r.case:<15}{r.process:<15}{fmt(r.detect_s):>9}{fmt(r.clients_s):>10}{ex:>15}  "
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
