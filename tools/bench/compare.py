"""The headline comparison: Subway continuous batching against static batching, one run, one workload.

Runs, one after another on the same machine and the same JSONL workload:
  - Subway (`subway serve`, continuous batching with overlap) in each `--subway-dtypes`,
  - Subway `--policy static` (classic static batching inside the same engine),
  - transformers static batching (`generate` on padded batches) for each batch size and dtype,
  - transformers' own continuous batching, where the installed version has it,
then prints one table of output throughput, ratios and latencies, and writes JSON.

    python -m subway.tools.bench.compare --out docs/bench/compare.json

The Subway runs go through HTTP with streaming (tools/bench/bench_serving.py); the
transformers runs are offline (tools/bench/bench_hf.py), which only flatters them.
While Subway serves, /metrics is sampled to find the peak of KV blocks in use,
against what a static allocation to the longest sequence would have reserved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from subway.tools import serve_process
from subway.tools.bench import bench_hf, bench_serving, workload
from subway.tools.serve_process import free_port

_free_port = free_port  # the name tools/bench/vs_vllm.py uses

# Arithmetic bounds of this CPU for the standard workload, from the measurement
# (180 GFLOP/s float32, 410 GFLOP/s bfloat16 over the workload's FLOPs).
BOUND_TOKENS_PER_S = {"float32": 270.0, "bfloat16": 620.0}


class KvSampler(threading.Thread):
    """Samples /metrics while a run goes on: peak KV blocks in use."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.peak_used = 0.0
        self.total = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self.done.is_set():
                try:
                    m = bench_serving.parse_prometheus(
                        c.get(self.url).text,
                        ("subway:kv_cache_usage_perc", "subway:kv_blocks_free"),
                    )
                except httpx.HTTPError:
                    m = {}
                usage = m.get("subway:kv_cache_usage_perc", 0.0)
                free = m.get("subway:kv_blocks_free")
                if free is not None and usage < 1.0:
                    total = free / (1.0 - usage) if usage < 1.0 else 0.0
                    self.total = max(self.total, round(total))
                self.peak_used = max(self.peak_used, usage)
                self.done.wait(0.5)  # a scrape costs the server ~2 ms of CPU: keep it rare


def wait_healthy(url: str, proc: subprocess.Popen, label: str, log: str, within_s: float) -> None:
    """serve_process.wait_healthy in this module's argument order (tools/bench/vs_vllm.py)."""
    serve_process.wait_healthy(url, proc, within_s, log=log, label=label)


@contextlib.contextmanager
def subway_server(label: str, flags: list[str], threads: int) -> Iterator[str]:
    """A `subway serve` on a free port for the duration of the block; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--port", str(port)]
    cmd += ["--allow-client-priority"]  # the workload's SLO fields reach the scheduler
    cmd += ["--threads", str(threads), "--dist-init-addr", f"127.0.0.1:{free_port()}", *flags]
    log = open(f"/tmp/subway-bench-{label}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        serve_process.wait_healthy(url, proc, 300, log=log.name, label=label)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def run_subway(
    label: str, reqs: list[workload.Request], flags: list[str], threads: int
) -> dict[str, Any]:
    with subway_server(label, flags, threads) as url:
        # Warm up (first-call costs: kernel build, allocator) outside the measurement, with
        # other prompts, so that the prefix cache holds none of the measured ones.
        bench_serving.benchmark(url, warmup_requests(), progress=False, keep_records=False)
        sampler = KvSampler(url + "/metrics")
        sampler.start()
        result = bench_serving.benchmark(
            url, reqs, metrics_url=url + "/metrics", progress=False, keep_records=False
        )
        sampler.done.set()
        sampler.join()
        result["kv_peak_usage"] = sampler.peak_used
        return result


def warmup_requests() -> list[workload.Request]:
    """Two short requests whose prompts share nothing with the seed-0 workloads."""
    return workload.generate(workload.load_tokenizer(), 2, seed=12345, max_output_tokens=16)


def static_kv_tokens(reqs: list[workload.Request], max_model_len: int) -> int:
    """KV slots a static allocation reserves: every request gets the model's full length."""
    return len(reqs) * max_model_len


def used_kv_tokens(reqs: list[workload.Request]) -> int:
    """KV slots the requests' tokens really need, all at once (the upper bound of paged use)."""
    return sum(r.prompt_tokens + r.max_tokens for r in reqs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--subway-dtypes", default="bfloat16,float32")
    p.add_argument("--hf-batch-sizes", default="8,16,32")
    p.add_argument("--hf-dtypes", default="float32,bfloat16")
    p.add_argument("--skip", default="", help="comma list of: subway,static,hf,cb")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))

    from subway.worker.default_model import ensure_default_model

    model = ensure_default_model()
    reqs = workload.generate(workload.load_tokenizer(model), a.num_requests, a.seed)
    summary = workload.summary(reqs)
    print(f"workload: {json.dumps(summary)}", flush=True)
    engine_flags = [
        "--max-num-seqs", str(a.max_num_seqs),
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
        "--max-model-len", "2048",
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"workload": summary, "threads": a.threads, "rows": rows}

    def add(system: str, dtype: str, r: dict[str, Any], **extra: Any) -> None:
        rows.append({"system": system, "dtype": dtype, **r, **extra})
        print(f"{system:<34} {dtype:<9} {r['output_throughput']:8.1f} tok/s", flush=True)

    if "subway" not in skip:
        for dtype in a.subway_dtypes.split(","):
            r = run_subway(f"cb-{dtype}", reqs, [*engine_flags, "--dtype", dtype], a.threads)
            m = r["metrics"]
            add(
                "subway continuous (overlap)", dtype,
                {"output_throughput": m["output_throughput"], "ttft_ms": m["ttft_ms"],
                 "itl_ms": m["itl_ms"], "e2e_ms": m.get("e2e_ms")},
                kv_peak_usage=r["kv_peak_usage"], server_metrics=r.get("server_metrics"),
            )  # fmt: skip
    if "static" not in skip:
        dtype = a.subway_dtypes.split(",")[0]
        r = run_subway(
            f"static-{dtype}", reqs, [*engine_flags, "--dtype", dtype, "--policy", "static",
             "--static-batch-window-ms", "500"],
            a.threads,
        )  # fmt: skip
        m = r["metrics"]
        add(
            "subway --policy static", dtype,
            {"output_throughput": m["output_throughput"], "ttft_ms": m["ttft_ms"],
             "itl_ms": m["itl_ms"], "e2e_ms": m.get("e2e_ms")},
        )  # fmt: skip
    modes = [m for m in ("static", "cb") if (m if m == "cb" else "hf") not in skip]
    if modes:
        hf = bench_hf.bench(
            model, reqs, modes, [int(b) for b in a.hf_batch_sizes.split(",")],
            a.hf_dtypes.split(","), threads=a.threads,
        )  # fmt: skip
        for r in hf["runs"]:
            if "output_throughput" not in r:
                continue
            name = "transformers static" if r["mode"] == "static" else "transformers continuous"
            if "batch_size" in r:
                name += f" bs={r['batch_size']}"
            add(
                name, r["dtype"],
                {"output_throughput": r["output_throughput"], "ttft_ms": r.get("ttft_ms"),
                 "e2e_ms": r.get("latency_ms")},
            )  # fmt: skip
        out["hf_cb_unavailable"] = hf.get("cb_unavailable")

    out["kv"] = {
        "static_allocation_tokens": static_kv_tokens(reqs, 2048),
        "all_requests_at_full_length_tokens": used_kv_tokens(reqs),
    }
    print(table(rows), flush=True)
    out["table"] = table(rows)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def table(rows: list[dict[str, Any]]) -> str:
    hf_static = [r for r in rows if r["system"].startswith("transformers static")]
    best_hf = max((r["output_throughput"] for r in hf_static), default=math.nan)
    sub_static = next(
        (r["output_throughput"] for r in rows if r["system"] == "subway --policy static"), math.nan
    )
    lines = [
        "| system | dtype | output tok/s | x best transformers static | x subway static "
        "| of CPU bound | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["output_throughput"]
        ttft, itl = r.get("ttft_ms") or {}, r.get("itl_ms") or {}
        bound = BOUND_TOKENS_PER_S.get(r["dtype"], math.nan)
        lines.append(
            f"| {r['system']} | {r['dtype']} | {t:.1f} | {t / best_hf:.2f} | {t / sub_static:.2f} "
            f"| {t / bound:.0%} | {ttft.get('p50', math.nan):.0f} / {ttft.get('p99', math.nan):.0f} "
            f"| {itl.get('p50', math.nan):.0f} / {itl.get('p99', math.nan):.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
