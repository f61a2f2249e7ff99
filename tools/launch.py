"""`subway serve`: start the scheduler, the workers and the frontend on this host, supervise them.

Each process is a fresh interpreter (`python -m subway.tools.cli <kind> --config-json -`,
the config as JSON on its standard input),
so nothing is inherited by fork and nothing crosses a boundary as pickle. If any
process dies, the others are stopped, shared memory is unlinked and `serve`
exits non-zero. Ctrl-C or SIGTERM stops the frontend first (it drains), then the
scheduler, which tells the workers to exit.

Once the engine is ready, `serve` also watches its frontend (`HealthWatch`, in
`tools/health_watch.py`): an engine that cannot serve for `UNHEALTHY_EXIT_S` (an error, a
silent scheduler, a hung frontend) stops everything. The watch asks over the frontend's
private liveness socket (`frontend/liveness.py`), one connection held for the whole run,
never over the public HTTP port: there, clients holding every connection the cap allows,
or every file descriptor the frontend has, would make the probe fail and `serve` stop a
healthy server. `/health` over HTTP is used only with a frontend that has no liveness socket.
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
import urllib.request

from subway.frontend.liveness import liveness_path
from subway.ipc import curve
from subway.ipc.config import EngineConfig, ParallelConfig
from subway.ipc.sockets import cleanup_ipc, secure_dir
from subway.tools.health_watch import (  # noqa: F401 - UNHEALTHY_EXIT_S: also the tests'
    UNHEALTHY_EXIT_S,
    HealthWatch,
    LivenessProbe,
)
from subway.tools.limits import raise_fd_limit  # noqa: F401 - also the cli's

STARTING_NOTE_S = 10.0  # while the engine starts, a line this often says what it waits for
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
    """Start every process of `config`'s engines, supervise them until Ctrl-C, SIGTERM or
    a failure, then stop them and clean up. Returns the exit code."""
    raise_fd_limit(config)
    prepared = _prepare_run(config)
    if prepared is None:
        return 1
    config, made_run_dir, made_key_file = prepared
    engines = engine_configs(config)
    procs: list[tuple[str, subprocess.Popen]] = []
    stop = StopRequest()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    probe = LivenessProbe(config)
    try:
        engine_of = _start_processes(config, engines, procs)
        print(f"subway: loading {config.model.path} ...", flush=True)
        code = _supervise(config, engines, procs, engine_of, probe, stop, demo)
    finally:
        probe.close()
        _stop(procs, drain_timeout=config.server.shutdown_timeout if code == 0 else 0.0)
        _clean_up(config, engines, made_run_dir, made_key_file)
        for s, h in old.items():
            signal.signal(s, h)
    print(f"subway: stopped (exit {code})", flush=True)
    return code


class StopRequest:
    """The handler of SIGINT and SIGTERM while `serve` runs: it only notes the request, and
    the supervising loop stops everything in order at its next turn."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        self.requested = True


def _prepare_run(config: EngineConfig) -> tuple[EngineConfig, bool, str | None] | None:
    """The run folder made safe and the CurveZMQ keys in place, before any child starts:
    (the config, naming the key file; whether this call made the folder; the key file it
    made, if any). None, with the reason printed, where either is refused."""
    try:
        made_run_dir = secure_dir(config.ipc.run_dir)
    except PermissionError as e:
        print(f"subway: refusing the run folder: {e}", file=sys.stderr)
        return None
    try:
        config, made_key_file = own_curve_keys(config)
        curve.require_key_file(config.ipc)  # a given file: refused here, before any child
    except (OSError, ValueError) as e:
        print(f"subway: no CurveZMQ keys: {e}", file=sys.stderr)
        if made_run_dir:
            with contextlib.suppress(OSError):
                os.rmdir(config.ipc.run_dir)
        return None
    return config, made_run_dir, made_key_file


def _start_processes(
    config: EngineConfig, engines: list[EngineConfig], procs: list[tuple[str, subprocess.Popen]]
) -> dict[str, int]:
    """Start the frontend, then each engine's scheduler and workers. Each process joins
    `procs` as it starts, so that a start that fails stops those before it. Returns each
    process's engine, by name."""
    many = len(engines) > 1
    engine_of: dict[str, int] = {}
    procs.append(("frontend", _spawn("frontend", config)))
    for i, engine in enumerate(engines):
        tag = f" (engine {i})" if many else ""
        names = [f"scheduler{tag}"]
        procs.append((names[0], _spawn("scheduler", engine)))
        for rank in range(config.parallel.tensor_parallel_size):
            names.append(f"worker {rank}{tag}")
            procs.append((names[-1], _spawn("worker", engine, "--rank", str(rank))))
        engine_of.update(dict.fromkeys(names, i))
    return engine_of


def _supervise(
    config: EngineConfig,
    engines: list[EngineConfig],
    procs: list[tuple[str, subprocess.Popen]],
    engine_of: dict[str, int],
    probe: LivenessProbe,
    stop: StopRequest,
    demo: bool,
) -> int:
    """Watch the processes until a stop is requested (0), or until the engine cannot serve
    (1): a process died (of the last engine that could serve), or the ready engine has
    been unhealthy for `UNHEALTHY_EXIT_S`. Announces the engine once it is ready."""
    ready = False
    watch = HealthWatch(probe)
    lost: set[int] = set()  # engines stopped after one of their processes died
    started = time.monotonic()
    note_at, said = started + STARTING_NOTE_S, ""
    while not stop.requested:
        if _handle_exits(engines, procs, engine_of, lost):
            return 1
        if ready and watch.due():
            failure = watch.check()
            if failure is not None:
                print(f"subway: {failure}; stopping", file=sys.stderr)
                return 1
        if not ready:
            reason = probe.reason()
            if reason is None:
                ready = True
                _announce(config, demo)
            elif (waiting := _waiting_for(reason)) != said or time.monotonic() >= note_at:
                # A start says each stage as it is reached, and every 10 s what it waits for.
                note_at, said = time.monotonic() + STARTING_NOTE_S, waiting
                print(f"subway: starting ({time.monotonic() - started:.0f} s): {waiting}",
                      flush=True)  # fmt: skip
        time.sleep(0.2)
    return 0


def _waiting_for(reason: str) -> str:
    """The probe's reason in a new user's words: before the frontend answers, its socket's
    error; after, the engines' state as the frontend says it ("engine not ready" while a
    worker loads its model)."""
    if reason.startswith("no answer"):
        return "processes started; waiting for the frontend"
    if reason == "engine not ready":
        return "the frontend is up; waiting for the engine (loading the model)"
    return f"the frontend is up; waiting for the engine ({reason})"


def _handle_exits(
    engines: list[EngineConfig],
    procs: list[tuple[str, subprocess.Popen]],
    engine_of: dict[str, int],
    lost: set[int],
) -> bool:
    """Whether a process that exited ends the run (said on stderr). Of several engines, one
    that lost a process is stopped and cleaned up, and joins `lost`; the others serve on."""
    many = len(engines) > 1
    dead = [(n, p.returncode) for n, p in procs if p.poll() is not None]
    # Killed by a signal first: within one poll a process's peers may have exited
    # too (code 1, on noticing it), and the cause is what to name.
    dead.sort(key=lambda d: d[1] >= 0)
    fatal = [d for d in dead if not many or engine_of.get(d[0]) not in lost]
    for name, rc in fatal:
        i = engine_of.get(name)
        if not many or i is None or len(lost | {i}) == len(engines):
            also = "".join(f" ({n} exited with code {c} too)" for n, c in fatal if n != name)
            print(f"subway: {name} exited with code {rc}{also}; stopping", file=sys.stderr)
            return True
        # One engine of several: stop the rest of it; the others serve on.
        print(f"subway: {name} exited with code {rc}; stopping engine {i}, the "
              f"other {len(engines) - len(lost) - 1} serve on", file=sys.stderr)  # fmt: skip
        lost.add(i)
        _stop([(n, p) for n, p in procs if engine_of.get(n) == i], drain_timeout=0.0)
        remove_engine_leftovers(engines[i])
    return False


def _announce(config: EngineConfig, demo: bool) -> None:
    """Where the ready engine serves; with `demo`, one request's answer."""
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


def _clean_up(
    config: EngineConfig,
    engines: list[EngineConfig],
    made_run_dir: bool,
    made_key_file: str | None,
) -> None:
    """After the processes stopped: the key file this run made (before its folder goes),
    then every engine's leftover shared memory and sockets."""
    if made_key_file is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(made_key_file)
    left = [path for e in engines[1:] for path in remove_leftovers(e, made_run_dir=False)]
    left += remove_leftovers(config, made_run_dir)
    if left:
        print(f"subway: removed leftover shared memory {left}", file=sys.stderr)
