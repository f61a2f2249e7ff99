"""`subway bench compare`: one workload against two OpenAI-compatible servers, alternately.

These VMs swing by up to 1.5x within an hour, so a figure means something only beside
another taken at the same time: each round runs the workload against A, then B (the order
swapped every other round), and the ratio B/A of each round is printed with its spread.
The workload, its flags and the client are `bench_serving`'s (`subway bench serve`).

    subway bench compare --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from subway.tools.bench.bench_serving import base_url, benchmark, requests_from_args
from subway.tools.bench.workload import add_workload_args

KEYS = ("output_throughput", "ttft_ms", "itl_ms")


def figures(result: dict[str, Any]) -> dict[str, float]:
    """Output tok/s, the TTFT and ITL medians (ms) and the failed requests of one run (a
    side that fails requests has a ratio that means little: the table shows them)."""
    m = result["metrics"]
    return {
        "output_throughput": m["output_throughput"],
        "ttft_ms": m["ttft_ms"]["p50"],
        "itl_ms": m["itl_ms"]["p50"],
        "failed": m["failed"],
    }


def compare(
    urls: dict[str, str], requests: list, rounds: int, model: str = "", max_concurrency: int = 0
) -> dict[str, Any]:
    """Rounds of A and B (B first in odd rounds); each round's figures and B/A ratios."""
    out: dict[str, Any] = {"urls": urls, "rounds": []}
    for i in range(rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        row: dict[str, Any] = {}
        for side in order:
            result = benchmark(urls[side], requests, model, max_concurrency, progress=False,
                               keep_records=False)  # fmt: skip
            row[side] = figures(result)
        row["ratio"] = {k: row["b"][k] / row["a"][k] if row["a"][k] else float("nan") for k in KEYS}
        out["rounds"].append(row)
    ratios = [r["ratio"]["output_throughput"] for r in out["rounds"]]
    out["throughput_ratio"] = {"median": statistics.median(ratios), "min": min(ratios),
                               "max": max(ratios)}  # fmt: skip
    return out


def format_table(out: dict[str, Any]) -> str:
    lines = [f"A = {out['urls']['a']}", f"B = {out['urls']['b']}", "",
             "| round | A tok/s | B tok/s | B/A | TTFT p50 A / B (ms) | ITL p50 A / B (ms) "
             "| failed A / B |",
             "|---:|---:|---:|---:|---|---|---|"]  # fmt: skip
    for i, r in enumerate(out["rounds"], 1):
        a, b = r["a"], r["b"]
        lines.append(
            f"| {i} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
            f"{r['ratio']['output_throughput']:.3f} | {a['ttft_ms']:.0f} / {b['ttft_ms']:.0f} | "
            f"{a['itl_ms']:.1f} / {b['itl_ms']:.1f} | {a['failed']} / {b['failed']} |"
        )
    t = out["throughput_ratio"]
    lines.append(f"\nthroughput B/A: median {t['median']:.3f}, {t['min']:.3f} to {t['max']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="subway bench compare", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--a", required=True, help="base URL of server A")
    p.add_argument("--b", required=True, help="base URL of server B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="", help="JSONL (default: from the workload flags)")
    p.add_argument("--limit", type=int, default=0, help="only the file's first N requests")
    p.add_argument("--model", default="", help="model name (default: each server's first)")
    p.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    p.add_argument("--out", default="", help="JSON result file")
    add_workload_args(p)
    a = p.parse_args(argv)
    urls = {"a": base_url(a.a), "b": base_url(a.b)}
    out = compare(urls, requests_from_args(a), a.rounds, a.model, a.max_concurrency)
    print(format_table(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
