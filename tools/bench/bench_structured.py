"""What structured outputs cost: the standard workload with every request under a JSON
schema, against the same workload without, side by side on one server.

One `subway serve` (bfloat16, the standard workload's engine flags, no prefix cache so
that every round does the same work) serves alternating rounds: plain, then every
request with `structured_outputs: {"json": SCHEMA}`, and so on. The requests keep
`ignore_eos` and their exact lengths, and SCHEMA cannot be complete before 256 tokens
(an array of at least 200 small objects), so the grammar masks every step of every
request: the cost measured is the worst case, not a constraint that ends early and
lets the rest of the output run free.

    python -m subway.tools.bench.bench_structured [--rounds 2] [--out docs/bench/structured.json]

Compile times (cold and cached) are `bench_grammar`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import httpx

from subway.tools.bench import bench_serving, compare, workload

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 0},
                    "word": {"type": "string", "maxLength": 12},
                },
                "required": ["n", "word"],
                "additionalProperties": False,
            },
            "minItems": 200,
        }
    },
    "required": ["steps"],
    "additionalProperties": False,
}
CONSTRAINED = {"structured_outputs": {"json": SCHEMA}}


def _check_constrained(url: str) -> None:
    """One constrained request, outside the measurement: the server takes the field
    (else the comparison would be of two plain runs) and the worker's compile is cached."""
    body = {"prompt": "List the steps.", "max_tokens": 24, "temperature": 0.0, **CONSTRAINED}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    text = r.json()["choices"][0]["text"]
    if not text.lstrip().startswith("{"):
        raise RuntimeError(f"the output does not follow the schema: {text[:80]!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    from subway.worker.default_model import ensure_default_model

    model = ensure_default_model()
    reqs = workload.generate(workload.load_tokenizer(model), a.num_requests, 0)
    flags = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--max-model-len", "2048",
             "--dtype", "bfloat16", "--no-prefix-caching"]  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "json_schema": []}
    with compare.subway_server("structured", flags, a.threads) as url:
        bench_serving.benchmark(url, compare.warmup_requests(), progress=False, keep_records=False)
        _check_constrained(url)
        for i in range(a.rounds):
            for arm, extra in (("plain", None), ("json_schema", CONSTRAINED)):
                r = bench_serving.benchmark(
                    url, reqs, progress=False, keep_records=False, extra=extra
                )
                if r["metrics"]["failed"]:
                    raise RuntimeError(f"{arm}: {r.get('errors')}")
                runs[arm].append(r["metrics"])
                m = r["metrics"]
                print(
                    f"round {i + 1} {arm:<12} {m['output_throughput']:7.1f} tok/s  "
                    f"TTFT p50 {m['ttft_ms']['p50']:7.0f} ms  ITL p50 {m['itl_ms']['p50']:5.1f} ms",
                    flush=True,
                )
    tput = {arm: statistics.mean(m["output_throughput"] for m in ms) for arm, ms in runs.items()}
    ratio = tput["json_schema"] / tput["plain"]
    print(f"mean: plain {tput['plain']:.1f} tok/s, json_schema {tput['json_schema']:.1f} tok/s, "
          f"ratio {ratio:.3f} (cost {100 * (1 - ratio):.1f}%)")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"schema": SCHEMA, "runs": runs, "throughput": tput, "ratio": ratio}, f, indent=1
            )


if __name__ == "__main__":
    main()
