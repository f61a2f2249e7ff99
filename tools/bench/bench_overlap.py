"""Overlap on and off, side by side in one run: throughput and how long the workers sit idle.

    python -m subway.tools.bench.bench_overlap [--num-requests 32] [--dtype bfloat16]

Starts `subway serve` twice on the default model (with overlap, then with
`--no-overlap`), runs the same workload through each, and reads the engine's
own step counters from /metrics before and after: steps, seconds rank 0 spent
running steps, seconds it waited for the next plan, seconds the scheduler spent
planning. The idle fraction is idle / (busy + idle): the share of the workers'
time lost to waiting for the scheduler.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from subway.tools.bench import bench_serving, workload
from subway.tools.bench.compare import subway_server, warmup_requests

COUNTERS = (
    "subway:num_steps_total",
    "subway:worker_busy_seconds_total",
    "subway:worker_idle_seconds_total",
    "subway:scheduler_seconds_total",
)


def counters(url: str) -> dict[str, float]:
    return bench_serving.parse_prometheus(httpx.get(url + "/metrics", timeout=10).text, COUNTERS)


def measure(label: str, reqs: list[workload.Request], flags: list[str], threads: int) -> dict:
    with subway_server(label, flags, threads) as url:
        bench_serving.benchmark(url, warmup_requests(), progress=False, keep_records=False)
        before = counters(url)
        r = bench_serving.benchmark(url, reqs, progress=False, keep_records=False)
        after = counters(url)
    d = {k.split(":")[1]: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    steps = max(1.0, d["num_steps_total"])
    busy, idle = d["worker_busy_seconds_total"], d["worker_idle_seconds_total"]
    return {
        "label": label,
        "output_throughput": r["metrics"]["output_throughput"],
        "steps": int(steps),
        "step_ms": 1e3 * busy / steps,
        "idle_ms_per_step": 1e3 * idle / steps,
        "idle_fraction": idle / max(1e-9, busy + idle),
        "scheduler_ms_per_step": 1e3 * d["scheduler_seconds_total"] / steps,
        "ttft_p50_ms": r["metrics"]["ttft_ms"]["p50"],
        "itl_p50_ms": r["metrics"]["itl_ms"]["p50"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from subway.worker.default_model import ensure_default_model

    reqs = workload.generate(
        workload.load_tokenizer(ensure_default_model()), a.num_requests, a.seed
    )
    flags = ["--dtype", a.dtype, "--max-model-len", "2048"]
    rows: list[dict[str, Any]] = [
        measure("overlap", reqs, flags, a.threads),
        measure("no-overlap", reqs, [*flags, "--no-overlap"], a.threads),
    ]
    print("| mode | output tok/s | steps | step ms | worker idle ms/step | idle % of step time "
          "| scheduler ms/step | TTFT p50 ms | ITL p50 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['output_throughput']:.1f} | {r['steps']} | {r['step_ms']:.1f} "
            f"| {r['idle_ms_per_step']:.2f} | {100 * r['idle_fraction']:.1f}% "
            f"| {r['scheduler_ms_per_step']:.2f} | {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.1f} |"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
