"""Goodput of a mixed workload: interactive chats next to batch jobs, per system and chat rate.

The workload (seeded, the same for every system): `--batch-jobs` batch jobs (class `batch`,
priority 1, no TTFT SLO; prompts uniform in `--batch-prompt` tokens, `--batch-output`
output tokens), all at 0 s (`--batch-arrival together`) or evenly spread over the chat
window (`steady`: job j of n at chat_start + j/n of the span to the last chat); then
`--chats` chats (class `interactive`, priority 0, `slo_ttft_ms` = the TTFT SLO; prompts
and outputs uniform in `--chat-prompt` and `--chat-output`) arriving by Poisson at each
chat rate from `--chat-start` s on. The chats come from their own RNG: the same seed gives
the same chats whatever the batch parameters, and at every rate, only their gaps scaled
by 1/rate. Requests are streamed /v1/completions (temperature 0, `ignore_eos`) sent by
tools/bench/bench_serving.py; Subway gets `priority`, `slo_class` and `slo_ttft_ms`,
vLLM only `priority` (and none under fcfs, which rejects it).

Each system (`subway:POLICY` with vs_vllm.ENGINE_FLAGS, `vllm:fcfs|priority` with its
`--scheduling-policy`; both with their prefix cache, as they serve by default, unless
`--no-prefix-caching`; each rate's prompts start with their own tag, so that no run finds
an earlier one's cached) is started once, warmed up, then runs each rate once the server is idle and
other processes leave the CPU. Per rate: attainment (the share of all chats, failed ones
included, with TTFT <= `--slo-ttft-ms` and TPOT <= `--slo-tpot-ms`; TTFT only for a
1-token chat), chat TTFT and TPOT p50/p99, batch output tokens/s (their tokens over first
batch start to last batch finish), batch completion time (last finish since the run's
start), and for Subway the deltas of its counters named like preempt/displaced/slo/chunk.
Goodput (DistServe): the highest chat rate whose attainment is still >= 90% (see
`goodput`).

    # heavy mix: 48 batch jobs of 256 tokens together + 60 chats at 6/s
    python -m subway.tools.bench.goodput --mix heavy --out docs/bench/goodput_heavy.json
    # light mix: 24 batch jobs + 60 chats at 4/s
    python -m subway.tools.bench.goodput --mix light --out docs/bench/goodput_light.json
    # the sweep: goodput per system, plotted
    python -m subway.tools.bench.goodput --mix heavy --rates 1 2 4 6 8 12 \\
        --out docs/bench/goodput_sweep.json --plot docs/img/goodput.png

Subway's edf can also cap batch prefill chunks for the TPOT SLO: add
`--subway-args "--slo-tpot-ms 100"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import time
from typing import Any

import httpx
import numpy as np
import uvloop

from subway.tools.bench import bench_serving, compare, vs_vllm, workload
from subway.tools.bench.bench_serving import Record, Slo, stats_ms
from subway.tools.bench.workload import Request

TARGET = 0.9  # DistServe's attainment target
PRESETS = {"heavy": {"batch_jobs": 48, "rate": 6.0}, "light": {"batch_jobs": 24, "rate": 4.0}}
ALL_SYSTEMS = ("subway:fcfs", "subway:edf", "subway:priority", "vllm:fcfs", "vllm:priority")
VLLM_POLICIES = ("fcfs", "priority")
COUNTER_WORDS = ("preempt", "displaced", "slo", "chunk")


@dataclasses.dataclass(frozen=True)
class Mix:
    """The workload's parameters, all but the chat rate."""

    batch_jobs: int = 48
    batch_prompt: tuple[int, int] = (256, 768)
    batch_output: int = 256
    batch_arrival: str = "together"  # or "steady"
    chats: int = 60
    chat_prompt: tuple[int, int] = (32, 256)
    chat_output: tuple[int, int] = (16, 64)
    chat_start: float = 1.0
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 100.0
    seed: int = 0


def make_workload(builder: Any, mix: Mix, rate: float) -> list[Request]:
    """The requests at one chat rate, sorted by arrival; `builder.build(rng, n)` -> (text, n).

    Every random draw is made in a fixed order that depends on neither the rate nor (for the
    chats) the batch parameters: chats use RNG (seed, 1), batch jobs RNG (seed, 2)."""
    if rate <= 0 or math.isinf(rate):
        raise ValueError(f"chat rate must be finite and > 0, not {rate}")
    crng = np.random.default_rng([mix.seed, 1])
    gaps = crng.exponential(1.0, mix.chats)  # unit-rate Poisson gaps, scaled below
    c_prompt = crng.integers(mix.chat_prompt[0], mix.chat_prompt[1] + 1, mix.chats)
    c_out = crng.integers(mix.chat_output[0], mix.chat_output[1] + 1, mix.chats)
    arrivals = mix.chat_start + np.cumsum(gaps) / rate
    chats: list[Request] = []
    for i in range(mix.chats):
        text, n = builder.build(crng, int(c_prompt[i]))
        chats.append(
            Request(f"chat-{i:05d}", text, n, int(c_out[i]), round(float(arrivals[i]), 6),
                    priority=0, slo_class="interactive", slo_ttft_ms=mix.slo_ttft_ms)
        )  # fmt: skip
    brng = np.random.default_rng([mix.seed, 2])
    b_prompt = brng.integers(mix.batch_prompt[0], mix.batch_prompt[1] + 1, mix.batch_jobs)
    end = float(arrivals[-1]) if mix.chats else mix.chat_start
    out: list[Request] = []
    for j in range(mix.batch_jobs):
        if mix.batch_arrival == "together":
            t = 0.0
        elif mix.batch_arrival == "steady":
            t = mix.chat_start + (end - mix.chat_start) * j / mix.batch_jobs
        else:
            raise ValueError(f"batch arrival must be together or steady, not {mix.batch_arrival}")
        text, n = builder.build(brng, int(b_prompt[j]))
        out.append(
            Request(f"batch-{j:05d}", text, n, mix.batch_output, round(t, 6), priority=1,
                    slo_class="batch")
        )  # fmt: skip
    return sorted(out + chats, key=lambda r: r.arrival_s)  # stable: batch jobs first at a tie


def salted(requests: list[Request], k: int) -> list[Request]:
    """Each rate's prompts begin differently, so that with the prefix cache on (both servers,
    by default) a run never finds an earlier run's prompts cached; only what it shares within
    itself, and what a preempted request left, are hits."""
    return [dataclasses.replace(r, prompt=f"({k}) {r.prompt}") for r in requests]


def is_chat(r: Request) -> bool:
    return r.slo_class == "interactive"


def point_metrics(
    requests: list[Request], records: list[Record], slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """One (system, rate) run: chat SLO attainment and latencies, batch throughput."""
    slo = Slo(slo_ttft_ms, slo_tpot_ms)
    chats = [rec for q, rec in zip(requests, records, strict=True) if is_chat(q)]
    batch = [rec for q, rec in zip(requests, records, strict=True) if not is_chat(q)]
    ok_chats = [r for r in chats if r.success]
    ok_batch = [r for r in batch if r.success]
    met = sum(slo.met(r) for r in chats)
    tokens = sum(r.output_tokens for r in ok_batch)
    if ok_batch:
        first = min(r.start for r in ok_batch)
        last = max(r.start + r.e2e for r in ok_batch)
        tok_s, done = tokens / max(last - first, 1e-9), last
    else:
        tok_s, done = math.nan, math.nan
    return {
        "chats": len(chats),
        "chats_met": met,
        "attainment": met / len(chats) if chats else math.nan,
        "chats_failed": len(chats) - len(ok_chats),
        "ttft_ms": stats_ms([r.ttft for r in ok_chats]),
        "tpot_ms": stats_ms([r.tpot for r in ok_chats]),
        "batch_jobs": len(batch),
        "batch_failed": len(batch) - len(ok_batch),
        "batch_output_tokens": tokens,
        "batch_tokens_per_s": tok_s,
        "batch_completion_s": done,
    }


def goodput(points: list[tuple[float, float]], target: float = TARGET) -> tuple[float, str]:
    """(goodput, flag) from (rate, attainment) points: the highest rate with attainment >=
    `target`. Walking up the sorted rates to the first one below target: none below gives
    (the highest rate, ">="); the lowest below gives (0, "<": under the lowest rate swept);
    else the rate is linearly interpolated between the last passing and the first failing
    point, flag "" (higher rates are not looked at, even if they pass again)."""
    pts = sorted(points)
    if not pts:
        return math.nan, ""
    for i, (rate, att) in enumerate(pts):
        if att >= target:
            continue
        if i == 0:
            return 0.0, "<"
        r0, a0 = pts[i - 1]
        return r0 + (a0 - target) / (a0 - att) * (rate - r0), ""
    return pts[-1][0], ">="


def goodput_text(value: float, flag: str, rates: list[float]) -> str:
    if flag == "<":
        return f"< {min(rates):g} chats/s"
    return f"{flag + ' ' if flag else ''}{value:.2f} chats/s"


def parse_systems(items: list[str]) -> list[tuple[str, str]]:
    """'engine:policy' -> (engine, policy); ValueError for an unknown one."""
    from subway.scheduler.policy import POLICIES

    out = []
    for item in items:
        engine, _, policy = item.partition(":")
        known = POLICIES if engine == "subway" else VLLM_POLICIES if engine == "vllm" else ()
        if policy not in known:
            raise ValueError(f"unknown system {item!r}: subway:{{{','.join(POLICIES)}}} "
                             f"or vllm:{{{','.join(VLLM_POLICIES)}}}")  # fmt: skip
        out.append((engine, policy))
    return out


def for_system(requests: list[Request], engine: str, policy: str) -> list[Request]:
    """vLLM rejects a nonzero `priority` unless its policy is `priority`: drop it there."""
    if engine == "vllm" and policy != "priority":
        return [dataclasses.replace(r, priority=None) for r in requests]
    return requests


def summed(text: str, wanted: Any) -> dict[str, float]:
    """Prometheus text: the samples whose name passes `wanted(name)`, summed over labels."""
    names = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    return bench_serving.parse_prometheus(text, tuple(sorted(n for n in names if wanted(n))))


def counters(text: str, words: tuple[str, ...] = COUNTER_WORDS) -> dict[str, float]:
    """The counters (`*_total`) whose name holds one of `words`."""
    return summed(text, lambda n: n.endswith("_total") and any(w in n for w in words))


def scrape_counters(url: str) -> dict[str, float] | None:
    try:
        return counters(httpx.get(url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None


def wait_idle(url: str, within_s: float = 120.0) -> bool:
    """Until the server reports no request running or waiting (its *num_requests_running and
    *num_requests_waiting gauges; Subway and vLLM both have them); False if it never did."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return False
        busy = summed(text, lambda n: n.endswith(("num_requests_running", "num_requests_waiting")))
        if sum(busy.values()) == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def run_point(
    url: str, engine: str, requests: list[Request], mix: Mix, timeout: float
) -> dict[str, Any]:
    """One run of one rate's requests against a warm, idle server."""
    before = scrape_counters(url)  # vLLM's too: vllm:num_preemptions_total
    during = vs_vllm.ForeignCpu()
    during.start()
    records, duration = uvloop.run(  # as bench_serving.benchmark runs its client
        bench_serving.run_requests(
            url, requests, timeout=timeout, progress=False, slo_fields=engine == "subway"
        )
    )
    m = point_metrics(requests, records, mix.slo_ttft_ms, mix.slo_tpot_ms)
    m["duration_s"] = duration
    m["foreign_cores_during"] = during.cores()
    if before is not None and (after := scrape_counters(url)) is not None:
        m["counters"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if errors := [r.error for r in records if r.error]:
        m["errors"] = errors[:10]
    return m


def run_system(
    engine: str, policy: str, workloads: dict[float, list[Request]], mix: Mix, a: argparse.Namespace
) -> dict[str, Any]:
    """Start the system's server once, warm it up, run each rate; its points and goodput."""
    if engine == "subway":
        flags = [
            f for f in vs_vllm.ENGINE_FLAGS if a.no_prefix_caching or f != "--no-prefix-caching"
        ]
        flags[flags.index("--max-num-batched-tokens") + 1] = str(a.max_num_batched_tokens)
        flags += ["--policy", policy, *shlex.split(a.subway_args)]
        server = compare.subway_server(f"goodput-{policy}", flags, a.threads)
    else:
        from subway.worker.default_model import ensure_default_model

        flags = ["--scheduling-policy", policy]
        flags += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        flags += [] if a.no_prefix_caching else ["--enable-prefix-caching"]  # after VLLM_FLAGS'
        flags += shlex.split(a.vllm_args)
        server = vs_vllm.vllm_server(ensure_default_model(), a.threads, a.kv_gib, flags)
    points = []
    with server as url:
        bench_serving.benchmark(url, compare.warmup_requests(), progress=False, keep_records=False)
        for rate, reqs in workloads.items():
            idle = wait_idle(url)
            foreign = vs_vllm.wait_for_quiet(a.max_foreign_cores, a.quiet_wait_s)
            m = run_point(url, engine, for_system(reqs, engine, policy), mix, a.timeout)
            points.append({"rate": rate, "idle_before": idle, "foreign_cores_before": foreign, **m})
            print(f"  {engine}:{policy} at {rate:g} chats/s: {m['attainment']:.0%} within SLO, "
                  f"batch {m['batch_tokens_per_s']:.1f} tok/s", flush=True)  # fmt: skip
    value, flag = goodput([(p["rate"], p["attainment"]) for p in points])
    return {"flags": flags, "points": points, "goodput": value, "goodput_flag": flag}


def table(systems: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per system and rate."""
    lines = [
        "| system | chat rate /s | chats within SLO | chat TTFT p50 / p99 ms "
        "| chat TPOT p50 / p99 ms | batch tok/s | batch done s | failed chats / batch "
        "| counters |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, s in systems.items():
        for p in s["points"]:
            t, o = p["ttft_ms"], p["tpot_ms"]
            c = ", ".join(f"{k.split(':')[-1]} {v:g}" for k, v in p.get("counters", {}).items())
            lines.append(
                f"| {label} | {p['rate']:g} | {p['attainment']:.0%} "
                f"| {t['p50']:.0f} / {t['p99']:.0f} | {o['p50']:.1f} / {o['p99']:.1f} "
                f"| {p['batch_tokens_per_s']:.1f} | {p['batch_completion_s']:.1f} "
                f"| {p['chats_failed']} / {p['batch_failed']} | {c or '-'} |"
            )
    return "\n".join(lines)


def plot(systems: dict[str, dict[str, Any]], path: str) -> str:
    """Attainment against chat rate (with the 90% line) and batch tokens/s against chat rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for label, s in systems.items():
        pts = sorted(s["points"], key=lambda p: p["rate"])
        rates = [p["rate"] for p in pts]
        ax1.plot(rates, [100 * p["attainment"] for p in pts], marker="o", label=label)
        ax2.plot(rates, [p["batch_tokens_per_s"] for p in pts], marker="o", label=label)
    ax1.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1, label="90%")
    ax1.set_ylabel("chats within both SLOs (%)")
    ax1.set_ylim(-3, 103)
    ax2.set_ylabel("batch output tokens/s")
    ax2.set_ylim(bottom=0)
    rates = sorted({p["rate"] for s in systems.values() for p in s["points"]})
    for ax in (ax1, ax2):
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("chat rate (chats/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def mix_from_args(a: argparse.Namespace) -> tuple[Mix, list[float]]:
    """The preset, overridden by any flag given; the chat rates to run."""
    preset = PRESETS[a.mix]
    mix = Mix(
        batch_jobs=preset["batch_jobs"] if a.batch_jobs is None else a.batch_jobs,
        batch_prompt=tuple(a.batch_prompt),
        batch_output=a.batch_output,
        batch_arrival=a.batch_arrival,
        chats=a.chats,
        chat_prompt=tuple(a.chat_prompt),
        chat_output=tuple(a.chat_output),
        chat_start=a.chat_start,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_tpot_ms=a.slo_tpot_ms,
        seed=a.seed,
    )
    return mix, list(a.rates or [preset["rate"]])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mix", choices=sorted(PRESETS), default="heavy")
    p.add_argument("--rates", type=float, nargs="+", help="chat rates (default: the mix's)")
    p.add_argument("--batch-jobs", type=int, default=None, help="default: the mix's")
    p.add_argument("--batch-prompt", type=int, nargs=2, default=[256, 768], metavar=("LO", "HI"))
    p.add_argument("--batch-output", type=int, default=256)
    p.add_argument("--batch-arrival", choices=("together", "steady"), default="together")
    p.add_argument("--chats", type=int, default=60)
    p.add_argument("--chat-prompt", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--chat-output", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    p.add_argument("--chat-start", type=float, default=1.0, help="first chats after this (s)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), help="engine:policy")
    p.add_argument("--subway-args", default="", help="extra `subway serve` flags (one string)")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags (one string)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument(
        "--max-foreign-cores", type=float, default=0.3,
        help="before each run, wait until other processes use less CPU than this",
    )  # fmt: skip
    p.add_argument("--quiet-wait-s", type=float, default=600.0, help="the most to wait for it")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048,
        help="both servers' token budget per step (2048: vLLM's CPU default for its server)",
    )  # fmt: skip
    p.add_argument(
        "--no-prefix-caching", action="store_true",
        help="both servers without a prefix cache (default: with, as each serves by default)",
    )  # fmt: skip
    p.add_argument("--out", default="", help="JSON result file")
    p.add_argument("--plot", default="", help="PNG, e.g. docs/img/goodput.png")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    try:
        systems = parse_systems(a.systems)
    except ValueError as e:
        p.error(str(e))
    mix, rates = mix_from_args(a)
    if any(r <= 0 or math.isinf(r) for r in rates):
        p.error("--rates must be finite and > 0")
    builder = workload.TextBuilder(workload.load_tokenizer())
    workloads = {r: salted(make_workload(builder, mix, r), k) for k, r in enumerate(rates)}
    print(f"workload: {json.dumps(dataclasses.asdict(mix))}, rates {rates}", flush=True)
    if any(e == "vllm" for e, _ in systems):  # install first, as vs_vllm does (idempotent)
        subprocess.run(["bash", vs_vllm.SCRIPT, "install"], check=True, stdout=subprocess.DEVNULL)
    results: dict[str, dict[str, Any]] = {}
    for engine, policy in systems:
        label = f"{engine}:{policy}"
        print(f"== {label}", flush=True)
        results[label] = run_system(engine, policy, workloads, mix, a)
    out: dict[str, Any] = {
        "mix": a.mix,
        "workload": dataclasses.asdict(mix),
        "rates": rates,
        "workload_summary": {f"{r:g}": workload.summary(w) for r, w in workloads.items()},
        "threads": a.threads,
        "target_attainment": TARGET,
        "systems": results,
        "table": table(results),
        "prefix_caching": not a.no_prefix_caching,
    }
    print(out["table"])
    for label, s in results.items():
        print(f"goodput {label}: {goodput_text(s['goodput'], s['goodput_flag'], rates)}")
    if a.plot:
        out["plot"] = plot(results, a.plot)
        print(out["plot"])
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
