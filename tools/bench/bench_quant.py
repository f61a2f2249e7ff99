"""Quantized serving against bfloat16, side by side in one run: speed, KV capacity, accuracy.

    python -m subway.tools.bench.bench_quant --out docs/bench/quant.json [--rounds 2]

Subway is served (the vLLM comparison's engine flags: bfloat16, both cores) in each
setting: `bf16`, `int8` (`--quantization int8`), `int8+kv8` (and `--kv-cache-dtype
int8`) and `kv8` (bfloat16 weights, 8-bit KV), in ABBA rounds. On each server:

- `c64`: the standard workload (64 requests, seed 0) all at once: output tokens/s;
- capacity: the KV pool in tokens at the same `--kv-cache-memory` (`kv_blocks_free` on
  /metrics before any request, times the block size);
- perplexity (first round only: it does not change): held-out text through `echo` and
  prompt logprobs on /v1/completions: `--ppl-windows` windows of 512 tokens of Python's
  own documentation (`pydoc_data.topics`, the same on every machine with this Python).

Then `--pressure-memory` (a KV pool too small for the standard workload at once) for
`bf16` and `kv8`: the preemptions each counts (`subway:num_preemptions`) and its tok/s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

import httpx

from subway.tools.bench import bench_serving, compare, vs_vllm, workload

SETTINGS = {
    "bf16": [],
    "int8": ["--quantization", "int8"],
    "int8+kv8": ["--quantization", "int8", "--kv-cache-dtype", "int8"],
    "kv8": ["--kv-cache-dtype", "int8"],
}
WINDOW = 512
BLOCK_SIZE = 16  # the default --block-size


def heldout_windows(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` windows of WINDOW tokens of `pydoc_data.topics` (its topics in sorted order)."""
    from pydoc_data import topics

    text = "\n\n".join(v for _, v in sorted(topics.topics.items()))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n * WINDOW:
        raise ValueError(f"only {len(ids)} tokens of text for {n} windows")
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(n)]


def perplexity(url: str, model: str, windows: list[list[int]]) -> float:
    """exp of the mean negative logprob of every token after the first of each window."""
    total, count = 0.0, 0
    with httpx.Client(timeout=600) as client:
        for w in windows:
            body = {"prompt": w, "max_tokens": 0, "echo": True, "logprobs": 0}
            if model:
                body["model"] = model
            r = client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            vals = [x for x in lps[1:] if x is not None]
            if len(vals) != len(w) - 1:
                raise RuntimeError(f"{len(vals)} prompt logprobs for {len(w)} tokens")
            total -= sum(vals)
            count += len(vals)
    return math.exp(total / count)


def server_metrics(url: str) -> dict[str, float]:
    got = bench_serving.parse_prometheus(
        httpx.get(url + "/metrics", timeout=10).text,
        ("subway:kv_blocks_free", "subway:num_preemptions_total"),
    )
    return {k.removeprefix("subway:").removesuffix("_total"): v for k, v in got.items()}


def c64(url: str, std: list[workload.Request]) -> dict[str, Any]:
    bench_serving.benchmark(url, compare.warmup_requests(), progress=False, keep_records=False)
    idle = server_metrics(url)  # after a step: the stats are the engine's (no prefix cache)
    before = idle["num_preemptions"]
    quiet = vs_vllm.wait_for_quiet(0.3, 600.0)
    r = bench_serving.benchmark(url, std, max_concurrency=64, progress=False, keep_records=False)
    m = r["metrics"]
    return {
        "foreign_cores_before": quiet,
        "output_throughput": m["output_throughput"],
        "tpot_ms": m["tpot_ms"],
        "ttft_ms": m["ttft_ms"],
        "failed": m["failed"],
        "preemptions": server_metrics(url)["num_preemptions"] - before,
        "kv_tokens": int(idle["kv_blocks_free"]) * BLOCK_SIZE,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--pressure-memory", type=int, default=64 << 20, help="bytes; 0: skip")
    p.add_argument("--model", default="", help="an HF folder (default: the default model)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from subway.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    model = a.model or ensure_default_model()
    served = "" if a.model else DEFAULT_MODEL_NAME  # "": the server's own
    tok = workload.load_tokenizer(model)
    std = workload.generate(tok, num_requests=64, seed=0)
    windows = heldout_windows(tok, a.ppl_windows)
    names = a.settings.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    ppl: dict[str, float] = {}
    capacity: dict[str, int] = {}
    for i in range(a.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            print(f"round {i + 1}: {name}", flush=True)
            flags = [*vs_vllm.ENGINE_FLAGS, *SETTINGS[name], "--model", model]
            with compare.subway_server(f"quant-{name}", flags, a.threads) as url:
                r = c64(url, std)
                capacity[name] = r["kv_tokens"]
                if name not in ppl:
                    ppl[name] = perplexity(url, served, windows)
                runs[name].append(r)
                print(f"  {r['output_throughput']:.1f} tok/s, KV {capacity[name]} tokens, "
                      f"perplexity {ppl[name]:.3f}", flush=True)  # fmt: skip
    pressure: dict[str, dict] = {}
    if a.pressure_memory:
        for name in [n for n in ("bf16", "kv8") if n in names]:
            mem = ["--kv-cache-memory", str(a.pressure_memory)]
            flags = [*vs_vllm.ENGINE_FLAGS, *SETTINGS[name], *mem, "--model", model]
            with compare.subway_server(f"quant-pressure-{name}", flags, a.threads) as url:
                pressure[name] = r = c64(url, std)
                print(f"pressure {name}: {r['kv_tokens']} KV tokens, "
                      f"{pressure[name]['preemptions']:.0f} preemptions, "
                      f"{pressure[name]['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
    tok_s = {n: statistics.median(r["output_throughput"] for r in runs[n]) for n in names}
    base = names[0]
    summary = {
        "c64_tok_s": tok_s,
        "c64_over_" + base: {n: tok_s[n] / tok_s[base] for n in names},
        "perplexity": ppl,
        "perplexity_over_" + base: {n: ppl[n] / ppl[base] for n in names},
        "kv_tokens": capacity,
        "kv_tokens_over_" + base: {n: capacity[n] / capacity[base] for n in names},
        "pressure": {
            n: {k: v[k] for k in ("kv_tokens", "preemptions", "output_throughput")}
            for n, v in pressure.items()
        },
    }
    print(json.dumps(summary, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs, "pressure": pressure, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
