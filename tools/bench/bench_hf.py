"""`transformers` baselines on a JSONL workload, offline (no HTTP), on the same model.

static: `generate` on left-padded batches taken in arrival order. A batch starts once its
last member has arrived and the previous batch has ended, and runs until its longest
member is done (min_new_tokens = max_new_tokens = the batch's longest `max_tokens`, so
EOS never ends it early); only each request's own `max_tokens` count as useful output.
TTFT is when the batch's first decoding step ends, latency when the batch ends, both
from the request's arrival.

cb: transformers' own continuous batching (`model.init_continuous_batching()`, the
manager behind `generate_batch`), one `add_request` per request at its arrival with its
own `max_new_tokens` and EOS disabled; TTFT and latency from its per-token timestamps.

    python -m subway.tools.bench.bench_hf --workload wl.jsonl --mode static \\
        --batch-sizes 8,16,32 --dtypes float32,bfloat16 --out hf.json [--limit N]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from subway.tools.bench.bench_serving import stats_ms
from subway.tools.bench.workload import Request, load_jsonl

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(model_path: str, dtype: str, attn: str = "sdpa") -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=DTYPES[dtype], attn_implementation=attn
    )
    return model.eval(), tok


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def summarize(
    reqs: list[Request], ttft: list[float], latency: list[float], wall: float, generated: int
) -> dict[str, Any]:
    useful = sum(r.max_tokens for r in reqs)
    return {
        "num_requests": len(reqs),
        "wall_s": wall,
        "output_tokens": useful,
        "generated_tokens": generated,
        "output_throughput": useful / wall,
        "total_token_throughput": (useful + sum(r.prompt_tokens for r in reqs)) / wall,
        "request_throughput": len(reqs) / wall,
        "ttft_ms": stats_ms(ttft),
        "latency_ms": stats_ms(latency),
    }


class FirstStep:
    """A stopping criterion that never stops: it notes when the first new token exists."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        if self.time is None:
            self.time = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def run_static(model: Any, tok: Any, reqs: list[Request], batch_size: int) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    reqs = sorted(reqs, key=lambda r: r.arrival_s)
    ttft: list[float] = []
    latency: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        wait_until(t0 + batch[-1].arrival_s)
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True)
        n = max(r.max_tokens for r in batch)
        first = FirstStep()
        out = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            stopping_criteria=StoppingCriteriaList([first]),
        )
        end = time.perf_counter()
        generated += (out.shape[1] - enc["input_ids"].shape[1]) * len(batch)
        for r in batch:
            arrival = t0 + r.arrival_s
            ttft.append((first.time or end) - arrival)
            latency.append(end - arrival)
    wall = time.perf_counter() - t0
    return summarize(reqs, ttft, latency, wall, generated)


@torch.inference_mode()
def run_cb(model: Any, tok: Any, reqs: list[Request]) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in reqs),
        eos_token_id=-1,
        pad_token_id=tok.pad_token_id,
    )
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_tokens for r in reqs) + 8,
        max_generated_length=max(r.max_tokens for r in reqs),
        num_requests=len(reqs),
    )
    manager = model.init_continuous_batching(generation_config=gen, workload_hints=hints)
    manager.warmup()
    manager.start()
    try:
        collect(manager, {"warmup": [1, 2, 3, 4]}, 4)  # the first step allocates the cache
        reqs = sorted(reqs, key=lambda r: r.arrival_s)
        ids = {r.id: tok(r.prompt)["input_ids"] for r in reqs}
        t0 = time.perf_counter()
        arrival = {}
        for r in reqs:
            wait_until(t0 + r.arrival_s)
            arrival[r.id] = time.perf_counter()
            manager.add_request(
                ids[r.id], request_id=r.id, max_new_tokens=r.max_tokens,
                record_timestamps=True, eos_token_id=-1,
            )  # fmt: skip
        results = collect(manager, {}, 0, expect=len(reqs))
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=10)
    failed = [k for k, v in results.items() if v.error]
    ttft = [(v.timestamps or [math.nan])[0] - arrival[k] for k, v in results.items()]
    latency = [v.lifespan[1] - arrival[k] for k, v in results.items()]
    generated = sum(len(v.generated_tokens) for v in results.values())
    out = summarize(reqs, ttft, latency, wall, generated)
    out["failed"] = len(failed) + len(reqs) - len(results)
    out["exact_lengths"] = all(
        len(results[r.id].generated_tokens) == r.max_tokens for r in reqs if r.id in results
    )
    return out


def collect(manager: Any, warm: dict[str, list[int]], n: int, expect: int = 0) -> dict[str, Any]:
    """Add the `warm` requests (n new tokens each), then wait for `expect` (or those) to finish."""
    for rid, ids in warm.items():
        manager.add_request(ids, request_id=rid, max_new_tokens=n, eos_token_id=-1)
    want = expect or len(warm)
    done: dict[str, Any] = {}
    while len(done) < want:
        res = manager.get_result(timeout=1)
        if res is not None and res.is_finished():
            done[res.request_id] = res
        elif res is None and not manager.is_running():
            break
    return done


def cb_available() -> str:
    """'' when transformers has continuous batching, else why not."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
        from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: F401
    except ImportError as e:
        return f"transformers has no continuous batching API: {e}"
    return ""


def warm_static(model: Any, tok: Any) -> None:
    enc = tok(["warm up"], return_tensors="pt")
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, min_new_tokens=4, pad_token_id=tok.pad_token_id)


def bench(
    model_path: str,
    reqs: list[Request],
    modes: list[str],
    batch_sizes: list[int],
    dtypes: list[str],
    threads: int = 2,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": model_path, "threads": threads, "runs": runs}
    for dtype in dtypes:
        model, tok = load(model_path, dtype)
        if "static" in modes:
            warm_static(model, tok)
            for bs in batch_sizes:
                r = run_static(model, tok, reqs, bs)
                runs.append({"mode": "static", "dtype": dtype, "batch_size": bs, **r})
                print(line(runs[-1]), flush=True)
        if "cb" in modes:
            why = cb_available()
            if why:
                result["cb_unavailable"] = why
            else:
                try:
                    runs.append({"mode": "cb", "dtype": dtype, **run_cb(model, tok, reqs)})
                    print(line(runs[-1]), flush=True)
                except Exception as e:  # report and go on: the static figures still count
                    runs.append({"mode": "cb", "dtype": dtype, "error": f"{type(e).__name__}: {e}"})
                    print(f"cb {dtype}: failed: {runs[-1]['error']}", flush=True)
        del model
    ok = [r for r in runs if "output_throughput" in r]
    for mode in ("static", "cb"):
        mine = [r for r in ok if r["mode"] == mode]
        if mine:
            result[f"best_{mode}"] = max(mine, key=lambda r: r["output_throughput"])
    return result


def line(r: dict[str, Any]) -> str:
    bs = f" bs={r['batch_size']:<3}" if "batch_size" in r else " " * 7
    return (
        f"{r['mode']:<7}{r['dtype']:<9}{bs} {r['output_throughput']:8.1f} tok/s  "
        f"wall {r['wall_s']:7.2f}s  TTFT p50 {r['ttft_ms']['p50']:8.0f}ms  "
        f"latency p50/p99 {r['latency_ms']['p50']:8.0f}/{r['latency_ms']['p99']:8.0f}ms"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="", help="Hugging Face folder (default: the default model)")
    p.add_argument("--mode", default="static", help="static, cb, or static,cb")
    p.add_argument("--batch-sizes", default="8,16,32")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--limit", type=int, default=0, help="only the first N requests")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    model = a.model
    if not model:
        from subway.worker.default_model import ensure_default_model

        model = ensure_default_model()
    reqs = load_jsonl(a.workload, a.limit)
    result = bench(
        model,
        reqs,
        a.mode.split(","),
        [int(x) for x in a.batch_sizes.split(",") if x],
        a.dtypes.split(","),
        a.threads,
    )
    result["workload"] = {"path": a.workload, "num_requests": len(reqs)}
    for mode in ("static", "cb"):
        if f"best_{mode}" in result:
            print("best", line(result[f"best_{mode}"]))
    if "cb_unavailable" in result:
        print("cb:", result["cb_unavailable"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
