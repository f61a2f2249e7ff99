"""Data parallelism on this host, side by side in one run: two engines of one thread each
(`--data-parallel-size 2 --threads 1`) against one engine of two threads (`--threads 2`).

    python -m subway.tools.bench.bench_dp --out docs/bench/dp.json [--rounds 2] [--dtype float32]

Both serve the default model with the vLLM comparison's engine flags (bfloat16 unless
`--dtype` says otherwise, no prefix cache: the standard workload's prompts share no full block), in ABBA rounds. On each
server, the standard workload (64 requests, seed 0) at each `--concurrency`: output
tokens/s, TTFT and TPOT (p50, p99), and how the requests spread over the engines
(`subway:routed_requests_total`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import httpx

from subway.tools.bench import bench_serving, compare, vs_vllm, workload

SETTINGS = {
    "one engine, 2 threads": (["--data-parallel-size", "1"], 2),
    "two engines, 1 thread each": (["--data-parallel-size", "2"], 1),
}


def routed(url: str) -> dict[str, float]:
    """Requests routed to each engine so far (a single engine routes none)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "subway:routed_requests_total":
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def measure(url: str, std: list[workload.Request], concurrency: int) -> dict[str, Any]:
    before = routed(url)
    quiet = vs_vllm.wait_for_quiet(0.3, 600.0)
    r = bench_serving.benchmark(
        url, std, max_concurrency=concurrency, progress=False, keep_records=False
    )
    m = r["metrics"]
    after = routed(url)
    return {
        "foreign_cores_before": quiet,
        "output_throughput": m["output_throughput"],
        "ttft_ms": m["ttft_ms"],
        "tpot_ms": m["tpot_ms"],
        "failed": m["failed"],
        "routed": {e: after[e] - before.get(e, 0.0) for e in after},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="64,16")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 as vs_vllm; float32 on a CPU "
                   "without bfloat16 instructions (AVX2 only)")  # fmt: skip
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from subway.worker.default_model import ensure_default_model

    tok = workload.load_tokenizer(ensure_default_model())
    std = workload.generate(tok, num_requests=64, seed=0)
    levels = [int(c) for c in a.concurrency.split(",")]
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            flags, threads = SETTINGS[name]
            print(f"round {i + 1}: {name}", flush=True)
            flags = [*vs_vllm.ENGINE_FLAGS, "--dtype", a.dtype, *flags]
            with compare.subway_server("dp", flags, threads) as url:
                bench_serving.benchmark(
                    url, compare.warmup_requests(), progress=False, keep_records=False
                )
                run = {f"c{c}": measure(url, std if c > 1 else std[:16], c) for c in levels}
            runs[name].append(run)
            for c in levels:
                r = run[f"c{c}"]
                print(f"  c{c}: {r['output_throughput']:.1f} tok/s, TTFT p50 "
                      f"{r['ttft_ms']['p50']:.0f} ms, TPOT p50 {r['tpot_ms']['p50']:.1f} ms, "
                      f"routed {r['routed']}", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    base, dp = names
    for c in levels:
        k = f"c{c}"
        tok_s = {n: statistics.median(r[k]["output_throughput"] for r in runs[n]) for n in names}
        ttft = {n: statistics.median(r[k]["ttft_ms"]["p50"] for r in runs[n]) for n in names}
        tpot = {n: statistics.median(r[k]["tpot_ms"]["p50"] for r in runs[n]) for n in names}
        summary[k] = {
            "tok_s": tok_s,
            "tok_s_ratio": tok_s[dp] / tok_s[base],
            "ttft_p50_ms": ttft,
            "tpot_p50_ms": tpot,
        }
    print(json.dumps(summary, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
