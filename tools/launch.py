"""`subway serve`: start the scheduler, the workers and the frontend on this host, supervise them.

Each process is a fresh interpreter (`python -m subway.tools.cli <kind> --config-json -`,
the config as JSON on its standard input),
so nothing is inherited by fork and nothing crosses a boundary as pickle. If any
process dies, the others are stopped, shared memory is unlinked and `serve`
exits non-zero. Ctrl-C or SIGTERM stops the frontend first (it drains), then the
scheduler, which tells the workers to exit.

Once the engine is ready, `serve` also watches its frontend (`HealthWatch`): an engine
that cannot serve for `UNHEALTHY_EXIT_S` (an error, a silent scheduler, a hung
frontend) stops everything. The watch asks over the frontend's private liveness
socket (`frontend/liveness.py`), one connection held for the whole run, never over the
public HTTP port: there, clients holding every connection the cap allows, or every
file descriptor the frontend has, would make the probe fail and `serve` stop a healthy
server. `/health` over HTTP is used only with a frontend that has no liveness socket.
The file-descriptor limit is raised to its hard limit at start (`raise_fd_limit`), for
the launcher and every process it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from subway.frontend.liveness import liveness_path, parse_answer
from subway.ipc import curve
from subway.ipc.config import EngineConfig, ParallelConfig
from subway.ipc.sockets import cleanup_ipc, secure_dir
from subway.tools.limits import raise_fd_limit  # noqa: F401 - also the cli's

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def _spawn(kind: str, config: EngineConfig, *extra: str) -> subprocess.Popen:
    """The config goes through the child's standard input, so that no secret in it (the
    API key) shows on a command line."""
    cmd = [sys.executable, "-m", "subway.tools.cli", kind, "--config-json", "-"]
    env = dict(os.environ, SUBWAY_PARENT_PID=str(os.getpid()))
    env.pop("SUBWAY_API_KEY", None)  # resolved into the config already
    if kind == "worker" and config.model.huge_pages:
        env["GLIBC_TUNABLES"] = with_huge_pages(env.get("GLIBC_TUNABLES", ""))
    # A session of its own: Ctrl-C reaches only the launcher, which stops the rest in order.
    proc = subprocess.Popen(
        [*cmd, *extra], env=env, start_new_session=True, stdin=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None
    proc.stdin.write(config.to_json())
    proc.stdin.close()
    return proc


def with_huge_pages(tunables: str) -> str:
    """GLIBC_TUNABLES with glibc's malloc asking for transparent huge pages (glibc 2.35+;
    older ones ignore it), unless the user set that tunable: a worker's weights are read
    whole every step, and with 4 KiB pages each read of a page is a TLB miss
    (docs/bench/log/2026-12-vs-vllm-avx512-amx.md, "Round 2": the batch-1 step 18.19 ->
    15.65 ms)."""
    if "glibc.malloc.hugetlb" in tunables:
        return tunables
    return f"{tunables}:glibc.malloc.hugetlb=1" if tunables else "glibc.malloc.hugetlb=1"


def die_with_parent() -> None:
    """In a process `serve` started: get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    parent = os.environ.get("SUBWAY_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def shm_names(config: EngineConfig) -> list[str]:
    """This run's shared memory now in /dev/shm: the sampled-token buffer, and every
    frontend's prompt buffer (each has a suffix of its own)."""
    prompts = config.ipc.prompt_shm_name + "_"
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return [n for n in names if n == config.ipc.sampled_shm_name or n.startswith(prompts)
            or _is_kv_segment(n, config)]  # fmt: skip


def _is_kv_segment(name: str, config: EngineConfig) -> bool:
    """A prefill engine's shared KV caches (`worker/kv_share.py`), `subway_RUN_kvRANK`, and
    its lease table (`ipc/kv_leases.py`), `subway_RUN_kvleases`."""
    head = f"{config.ipc.kv_source}_kv"
    return name == head + "leases" or (name.startswith(head) and name[len(head) :].isdigit())


def remove_leftovers(config: EngineConfig, made_run_dir: bool) -> list[str]:
    """Unlink this engine's shared memory and socket files, whoever left them, and the run
    folder if this launcher made it and it is empty: never anything else of a folder the
    user named. Returns the shared memory that was removed."""
    removed = []
    for name in shm_names(config):
        path = os.path.join("/dev/shm", name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    ipc = config.ipc
    cleanup_ipc(ipc.scheduler_addr, ipc.frontend_addr, ipc.plan_addr, ipc.result_addr)
    if config.client_address is not None:
        cleanup_ipc(config.client_address)
    with contextlib.suppress(FileNotFoundError):  # a frontend that died leaves it
        os.unlink(liveness_path(config))
    if made_run_dir:
        with contextlib.suppress(OSError):  # not empty: someone else's files stay
            os.rmdir(ipc.run_dir)
    return removed


def remove_engine_leftovers(config: EngineConfig) -> list[str]:
    """What one lost engine of several leaves: its sampled-token buffer, its shared KV
    caches (a prefill engine's) and the sockets its scheduler bound. The frontend, which
    serves on, keeps its own (its prompt buffer and socket for that engine)."""
    removed = []
    names = [n for n in shm_names(config) if not n.startswith(config.ipc.prompt_shm_name)]
    for name in names:
        path = os.path.join("/dev/shm", name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    ipc = config.ipc
    cleanup_ipc(ipc.scheduler_addr, ipc.plan_addr, ipc.result_addr)
    return removed


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


def demo_request(config: EngineConfig) -> str:
    body = json.dumps(
        {
            "model": config.model.served_model_name,
            "messages": [{"role": "user", "content": DEMO_PROMPT}],
            "max_tokens": 48,
            "temperature": 0,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    if config.server.api_key:
        headers["Authorization"] = f"Bearer {config.server.api_key}"
    req = urllib.request.Request(
        f"http://{config.server.host}:{config.server.port}/v1/chat/completions",
        data=body,
        headers=headers,
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _stop(procs: list[tuple[str, subprocess.Popen]], drain_timeout: float) -> None:
    """Stop in order: the frontend first (it drains for up to `drain_timeout`), then the
    scheduler (it tells the workers to exit), then any worker left; SIGKILL what will not go."""
    for i, (name, p) in enumerate(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped process hears SIGTERM only so
        try:
            p.wait(drain_timeout + 5 if name == "frontend" else 10)
        except subprocess.TimeoutExpired:
            print(f"subway: {name} did not stop; killing it", file=sys.stderr)
            for _, rest in procs[i:]:
                if rest.poll() is None:
                    rest.kill()
    for _, p in procs:
        p.wait()


UNHEALTHY_EXIT_S = 15.0  # a ready engine whose health check fails this long is stopped
HEALTH_PROBE_S = 1.0
PROBE_TIMEOUT_S = 2.0  # an answer later than this is none


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


def own_rendezvous(config: EngineConfig, default: bool | None = None) -> EngineConfig:
    """The config with a free rendezvous port of its own when tensor parallel ranks meet at
    the default address (`default`: whether they do, when `config` is one engine's, derived
    from a config that said): two engines on one host must never meet at the same one."""
    if config.parallel.tensor_parallel_size <= 1:
        return config
    if default is None:
        default = config.parallel.dist_init_addr == ParallelConfig().dist_init_addr
    if not default:
        return config  # the user's choice
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return config.replace(dist_init_addr=f"127.0.0.1:{port}")


def engine_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each data-parallel engine's config (`EngineConfig.engine`), with a rendezvous of its
    own where the user named none."""
    default = config.parallel.dist_init_addr == ParallelConfig().dist_init_addr
    n = max(1, config.parallel.data_parallel_size)
    return [own_rendezvous(config.engine(i), default) for i in range(n)]


def own_curve_keys(config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """When an internal address is tcp:// and no key file was given: a new key pair for
    this run in the run folder (created 0600, never over an existing file), named in the
    config the children get. Returns the config and the file this call made (None: none)."""
    if not curve.needs_curve(config.ipc) or config.ipc.curve_key_file:
        return config, None
    path = os.path.join(config.ipc.run_dir, curve.KEY_FILE_NAME)
    try:
        curve.write_key_file(path)
    except FileExistsError:
        raise FileExistsError(
            f"{path} exists already (another engine's?): give this engine a run folder of its "
            f"own, or its key file with {curve.KEY_FLAG}"
        ) from None
    return config.replace(curve_key_file=path), path


def serve(config: EngineConfig, demo: bool = False) -> int:
    raise_fd_limit(config)
    try:
        made_run_dir = secure_dir(config.ipc.run_dir)
    except PermissionError as e:
        print(f"subway: refusing the run folder: {e}", file=sys.stderr)
        return 1
    try:
        config, made_key_file = own_curve_keys(config)
        curve.require_key_file(config.ipc)  # a given file: refused here, before any child
    except (OSError, ValueError) as e:
        print(f"subway: no CurveZMQ keys: {e}", file=sys.stderr)
        if made_run_dir:
            with contextlib.suppress(OSError):
                os.rmdir(config.ipc.run_dir)
        return 1
    engines = engine_configs(config)
    many = len(engines) > 1
    procs: list[tuple[str, subprocess.Popen]] = []
    engine_of: dict[str, int] = {}  # process name -> its engine
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    probe = LivenessProbe(config)
    try:
        procs.append(("frontend", _spawn("frontend", config)))
        for i, engine in enumerate(engines):
            tag = f" (engine {i})" if many else ""
            names = [f"scheduler{tag}"]
            procs.append((names[0], _spawn("scheduler", engine)))
            for rank in range(config.parallel.tensor_parallel_size):
                names.append(f"worker {rank}{tag}")
                procs.append((names[-1], _spawn("worker", engine, "--rank", str(rank))))
            engine_of.update(dict.fromkeys(names, i))
        print(f"subway: loading {config.model.path} ...", flush=True)
        ready = False
        watch = HealthWatch(probe)
        lost: set[int] = set()  # engines stopped after one of their processes died
        while not stopping:
            dead = [(n, p.returncode) for n, p in procs if p.poll() is not None]
            # Killed by a signal first: within one poll a process's peers may have exited
            # too (code 1, on noticing it), and the cause is what to name.
            dead.sort(key=lambda d: d[1] >= 0)
            fatal = [d for d in dead if not many or engine_of.get(d[0]) not in lost]
            for name, rc in fatal:
                i = engine_of.get(name)
                if not many or i is None or len(lost | {i}) == len(engines):
                    also = "".join(
                        f" ({n} exited with code {c} too)" for n, c in fatal if n != name
                    )
                    print(f"subway: {name} exited with code {rc}{also}; stopping", file=sys.stderr)
                    code = 1
                    break
                # One engine of several: stop the rest of it; the others serve on.
                print(f"subway: {name} exited with code {rc}; stopping engine {i}, the "
                      f"other {len(engines) - len(lost) - 1} serve on", file=sys.stderr)  # fmt: skip
                lost.add(i)
                _stop([(n, p) for n, p in procs if engine_of.get(n) == i], drain_timeout=0.0)
                remove_engine_leftovers(engines[i])
            if code:
                break
            if ready and watch.due():
                failure = watch.check()
                if failure is not None:
                    print(f"subway: {failure}; stopping", file=sys.stderr)
                    code = 1
                    break
            if not ready and probe.reason() is None:
                ready = True
                url = f"http://{config.server.host}:{config.server.port}"
                print(f"subway: serving {config.model.served_model_name} at {url}/v1", flush=True)
                if config.client_address is not None:
                    zmq_addr = config.client_address
                    print(f"subway: native ZMQ client endpoint at {zmq_addr}", flush=True)
                if demo:
                    print(f"subway: demo> {DEMO_PROMPT}", flush=True)
                    try:
                        print(f"subway: demo< {demo_request(config).strip()}", flush=True)
                    except Exception as e:  # the demo must not take the server down
                        print(f"subway: demo request failed: {e}", file=sys.stderr)
                print("subway: press Ctrl-C to stop", flush=True)
            time.sleep(0.2)
    finally:
        probe.close()
        _stop(procs, drain_timeout=config.server.shutdown_timeout if code == 0 else 0.0)
        if made_key_file is not None:  # only the file this run made, before the folder goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made_key_file)
        left = [path for e in engines[1:] for path in remove_leftovers(e, made_run_dir=False)]
        left += remove_leftovers(config, made_run_dir)
        if left:
            print(f"subway: removed leftover shared memory {left}", file=sys.stderr)
        for s, h in old.items():
            signal.signal(s, h)
    print(f"subway: stopped (exit {code})", flush=True)
    return code
