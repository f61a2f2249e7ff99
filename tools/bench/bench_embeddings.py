"""Embeddings throughput: Subway's `/v1/embeddings` at `--concurrency` clients (one input per
request) against `transformers` in one process (the same model, float32, batches of
`--concurrency` padded inputs, the same pooling), phases alternated for `--rounds`; then
generation's throughput on the same server with and without a concurrent embeddings load
(`--gen-requests` of the standard workload, `workload.generate`, alone and beside
`--load-clients` clients that embed without pause), also alternated.

Inputs are `--num-inputs` texts of `--input-tokens` tokens (`workload.TextBuilder`,
seed 0). Prints one JSON row per phase, then the medians and spreads.

    python -m subway.tools.bench.bench_embeddings --rounds 3 [--out docs/bench/embeddings.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from subway.tools.bench import bench_serving, compare, workload

FLAGS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--max-model-len", "2048"]


def texts(tokenizer: Any, n: int, tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    builder = workload.TextBuilder(tokenizer)
    return [builder.build(rng, tokens)[0] for _ in range(n)]


async def _embed_all(url: str, inputs: list[str], clients: int, pooling: str) -> float:
    """Seconds to embed every input, one per request, `clients` at a time."""
    queue = list(reversed(inputs))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            text = queue.pop()
            r = await http.post(url + "/v1/embeddings", json={"input": text, "pooling": pooling})
            r.raise_for_status()

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - t0


def subway_rate(url: str, inputs: list[str], clients: int, pooling: str) -> float:
    return len(inputs) / asyncio.run(_embed_all(url, inputs, clients, pooling))


class Transformers:
    """The same model in this process: batches padded on the right, pooled as Subway does."""

    def __init__(self, model: str, threads: int) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model)
        self.tok.pad_token = self.tok.pad_token or self.tok.eos_token
        self.tok.padding_side = "right"
        self.model = AutoModel.from_pretrained(model, dtype=torch.float32).eval()

    def embed(self, batch: list[str], pooling: str) -> np.ndarray:
        torch = self.torch
        enc = self.tok(batch, return_tensors="pt", padding=True)
        with torch.inference_mode():
            h = self.model(**enc).last_hidden_state
        mask = enc.attention_mask
        if pooling == "mean":
            v = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        else:
            v = h[torch.arange(len(batch)), mask.sum(1) - 1]
        return torch.nn.functional.normalize(v, dim=-1).numpy()

    def rate(self, inputs: list[str], batch: int, pooling: str) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(inputs), batch):
            self.embed(inputs[i : i + batch], pooling)
        return len(inputs) / (time.perf_counter() - t0)


def generation(url: str, reqs: list, load: list[str] | None, clients: int) -> dict[str, Any]:
    """The workload's output tokens/s, beside an embeddings load (`load`) or not."""
    stop = threading.Event()
    done = [0]

    def embed_loop() -> None:
        async def run() -> None:
            async with httpx.AsyncClient(timeout=600) as http:

                async def one(k: int) -> None:
                    i = k
                    while not stop.is_set():
                        text = load[i % len(load)]  # type: ignore[index]
                        r = await http.post(url + "/v1/embeddings", json={"input": text})
                        r.raise_for_status()
                        done[0] += 1
                        i += clients

                await asyncio.gather(*(one(k) for k in range(clients)))

        asyncio.run(run())

    loader = threading.Thread(target=embed_loop) if load else None
    if loader is not None:
        loader.start()
    t0 = time.perf_counter()
    m = bench_serving.benchmark(url, reqs, progress=False)["metrics"]
    seconds = time.perf_counter() - t0
    stop.set()
    if loader is not None:
        loader.join()
    return {"output_throughput": m["output_throughput"], "failed": m["failed"],
            "itl_p50_ms": m["itl_ms"]["p50"], "embeddings_per_s": done[0] / seconds}  # fmt: skip


def summary(label: str, values: list[float]) -> str:
    return (f"{label}: median {statistics.median(values):.3f} "
            f"(spread {min(values):.3f}-{max(values):.3f}, {len(values)} rounds)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--pooling", default="last", choices=("last", "mean"))
    p.add_argument("--load-clients", type=int, default=4)
    p.add_argument("--gen-requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--pooling-share",
        type=float,
        default=None,
        help="the server's --pooling-share (default: the server's own)",
    )
    p.add_argument(
        "--generation-only",
        action="store_true",
        help="skip the embeddings-rate phase (measure generation beside a load only)",
    )
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    flags = list(FLAGS)
    if a.pooling_share is not None:
        flags += ["--pooling-share", str(a.pooling_share)]

    from subway.worker.default_model import ensure_default_model

    model = ensure_default_model()
    tok = workload.load_tokenizer(model)
    inputs = texts(tok, a.num_inputs, a.input_tokens)
    reqs = workload.generate(tok, a.gen_requests, 0)
    hf = Transformers(model, a.threads)
    rows: list[dict[str, Any]] = []
    with compare.subway_server("embeddings", ["--model", model, *flags], a.threads) as url:
        subway_rate(url, inputs[:64], a.concurrency, a.pooling)  # warm both
        hf.rate(inputs[:64], a.concurrency, a.pooling)
        for r in range(0 if a.generation_only else a.rounds):
            order = ("subway", "transformers") if r % 2 == 0 else ("transformers", "subway")
            for system in order:
                rate = (subway_rate(url, inputs, a.concurrency, a.pooling) if system == "subway"
                        else hf.rate(inputs, a.concurrency, a.pooling))  # fmt: skip
                rows.append({"round": r, "phase": "embed", "system": system, "inputs_per_s": rate})
                print(json.dumps(rows[-1]), flush=True)
        bench_serving.benchmark(url, compare.warmup_requests(), progress=False)
        for r in range(a.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for loaded in order:
                g = generation(url, reqs, inputs if loaded else None, a.load_clients)
                rows.append({"round": r, "phase": "generate", "embeddings_load": loaded, **g})
                print(json.dumps(rows[-1]), flush=True)
    by = {(x["round"], x["system"]): x["inputs_per_s"] for x in rows if x["phase"] == "embed"}
    gen = {(x["round"], x["embeddings_load"]): x for x in rows if x["phase"] == "generate"}
    speedup = [by[r, "subway"] / by[r, "transformers"] for r in range(a.rounds) if by]
    kept = [gen[r, True]["output_throughput"] / gen[r, False]["output_throughput"]
            for r in range(a.rounds)]  # fmt: skip
    if speedup:
        print(summary("embeddings inputs/s, Subway / transformers", speedup))
    print(summary("generation tokens/s kept under an embeddings load", kept))
    for loaded in (False, True):
        print(summary(f"generation ITL p50 ms, embeddings load {loaded}",
                      [gen[r, loaded]["itl_p50_ms"] for r in range(a.rounds)]))  # fmt: skip
    print(summary("embeddings/s alongside generation",
                  [gen[r, True]["embeddings_per_s"] for r in range(a.rounds)]))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "subway_over_transformers": speedup,
                       "generation_kept": kept}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
