"""Disaggregated prefill and decode on this host, side by side in one run: one prefill and
one decode engine, each pinned to a core of its own, against one colocated engine of two
threads, on an interference workload.

    python -m subway.tools.bench.bench_disagg --out docs/bench/disagg.json [--rounds 2]

The workload: `--streams` decode streams (short prompts, `--stream-tokens` output tokens
each) start together; `--long` long prompts (`--long-tokens` tokens, 16 output tokens)
arrive every `--every` seconds meanwhile. Reported per setting: the streams' inter-token
latency p50/p99 and TPOT, TTFT p50/p99 of each class, output tokens/s, and goodput: the
requests per second that met both TTFT <= `--ttft-slo-ms` and TPOT <= `--tpot-slo-ms`.
Both settings serve the default model with the same flags (`--dtype`, the prefix cache
on: the decode engine copies the prompts' blocks into it; every prompt differs); the
disaggregated setting's two worker
processes are pinned (engine 0 to CPU 0, engine 1 to CPU 1) once the server is up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

import numpy as np
import psutil

from subway.tools.bench import bench_serving, compare, vs_vllm, workload
from subway.tools.proc_title import parse

SETTINGS = {
    "colocated, 2 threads": ([], 2),
    "1 prefill + 1 decode, 1 core each": (["--prefill-engines", "1", "--decode-engines", "1"], 1),
}


def interference(tok: Any, a: argparse.Namespace) -> list[workload.Request]:
    rng = np.random.default_rng(0)
    builder = workload.TextBuilder(tok)
    out = []
    for i in range(a.streams):
        text, n = builder.build(rng, 48)
        out.append(workload.Request(f"stream-{i:03d}", text, n, a.stream_tokens, 0.0))
    for i in range(a.long):
        text, n = builder.build(rng, a.long_tokens)
        out.append(workload.Request(f"long-{i:03d}", text, n, 16, a.first + i * a.every))
    return out


def pin_workers(url: str) -> list[tuple[int, int]]:
    """Pin each engine's worker processes to CPU `engine` (of `subway serve` at `url`)."""
    port = int(url.rsplit(":", 1)[1])
    serve = next(
        p for p in psutil.process_iter(["cmdline"])
        if "serve" in (p.info["cmdline"] or []) and str(port) in (p.info["cmdline"] or [])
    )  # fmt: skip
    pinned = []
    for c in serve.children():
        what = parse(c.cmdline())
        if what.get("kind") == "worker":
            cpu = int(what.get("engine", "0")) % psutil.cpu_count()
            for t in c.threads():  # the OpenMP threads too
                psutil.Process(t.id).cpu_affinity([cpu])
            pinned.append((c.pid, cpu))
    return pinned


def summarize(result: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    recs = result["requests"]
    streams = [r for r in recs if r["id"].startswith("stream")]
    longs = [r for r in recs if r["id"].startswith("long")]
    itl = [x for r in streams for x in r["itl"]]

    def tpot(r: dict) -> float:
        n = r["output_tokens"]
        return (r["e2e"] - r["ttft"]) / (n - 1) if n > 1 else math.nan

    def met(r: dict) -> bool:
        ok_tpot = r["output_tokens"] < 2 or tpot(r) * 1e3 <= a.tpot_slo_ms
        return r["success"] and r["ttft"] * 1e3 <= a.ttft_slo_ms and ok_tpot

    m = result["metrics"]
    duration = m["duration_s"]
    return {
        "stream_itl_ms": bench_serving.stats_ms(itl),
        "stream_tpot_ms": bench_serving.stats_ms([tpot(r) for r in streams]),
        "stream_ttft_ms": bench_serving.stats_ms([r["ttft"] for r in streams]),
        "long_ttft_ms": bench_serving.stats_ms([r["ttft"] for r in longs]),
        "output_throughput": m["output_throughput"],
        "slo_met": sum(met(r) for r in recs),
        "goodput_rps": sum(met(r) for r in recs) / duration,
        "duration_s": duration,
        "failed": m["failed"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--first", type=float, default=1.0)
    p.add_argument("--every", type=float, default=3.0)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from subway.worker.default_model import ensure_default_model

    tok = workload.load_tokenizer(ensure_default_model())
    reqs = interference(tok, a)
    # The comparison's flags, but with the prefix cache: the decode engine copies into it.
    flags = ["--dtype", a.dtype, "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
             "--max-model-len", "2048"]  # fmt: skip
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            extra, threads = SETTINGS[name]
            print(f"round {i + 1}: {name}", flush=True)
            with compare.subway_server("disagg", [*flags, *extra], threads) as url:
                bench_serving.benchmark(
                    url, compare.warmup_requests(), progress=False, keep_records=False
                )
                pinned = pin_workers(url) if extra else []
                quiet = vs_vllm.wait_for_quiet(0.3, 600.0)
                result = bench_serving.benchmark(url, reqs, progress=False)
            s = summarize(result, a)
            s.update(pinned=pinned, foreign_cores_before=quiet)
            runs[name].append(s)
            print(f"  streams ITL p50 {s['stream_itl_ms']['p50']:.1f} p99 "
                  f"{s['stream_itl_ms']['p99']:.1f} ms; long TTFT p50 "
                  f"{s['long_ttft_ms']['p50']:.0f} ms; {s['output_throughput']:.1f} tok/s; "
                  f"SLO met {s['slo_met']}/{len(reqs)}", flush=True)  # fmt: skip

    def med(name: str, f) -> float:
        return statistics.median(f(r) for r in runs[name])

    summary = {
        n: {
            "stream_itl_p50_ms": med(n, lambda r: r["stream_itl_ms"]["p50"]),
            "stream_itl_p99_ms": med(n, lambda r: r["stream_itl_ms"]["p99"]),
            "stream_tpot_p50_ms": med(n, lambda r: r["stream_tpot_ms"]["p50"]),
            "stream_ttft_p50_ms": med(n, lambda r: r["stream_ttft_ms"]["p50"]),
            "long_ttft_p50_ms": med(n, lambda r: r["long_ttft_ms"]["p50"]),
            "long_ttft_p99_ms": med(n, lambda r: r["long_ttft_ms"]["p99"]),
            "output_throughput": med(n, lambda r: r["output_throughput"]),
            "goodput_rps": med(n, lambda r: r["goodput_rps"]),
            "slo_met": med(n, lambda r: r["slo_met"]),
        }
        for n in names
    }
    print(json.dumps(summary, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
