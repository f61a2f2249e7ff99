"""The batch-1 weight-read floor: how long one plain read of a model's weights takes here.

A decode step of one sequence reads every weight once, so no step can be faster than one
read of their bytes (in the serving dtype) from memory. This times `torch.sum` over one
tensor of that many bytes on `--threads` threads (the median of `--rounds` reads, after one
to warm up) and prints a JSON line: bytes, ms, GB/s. `vs_vllm` runs it before and after
its servers, so the single-stream ITL is set against a floor measured in the same run.

    python -m subway.tools.bench.read_floor [--model PATH] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
from safetensors import safe_open


def weight_elements(model: str) -> int:
    """Elements of every tensor in the folder's safetensors files (tied weights stored once)."""
    total = 0
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                for key in f.keys():
                    total += math.prod(f.get_slice(key).get_shape())
    return total


def measure(elements: int, dtype: torch.dtype, threads: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    buf = torch.ones(elements, dtype=dtype)
    buf.sum()  # first touch and warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    nbytes = elements * buf.element_size()
    ms = statistics.median(times) * 1e3
    return {"bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "threads": threads}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="a Hugging Face folder (default: the default model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args(argv)
    if not a.model:
        from subway.worker.default_model import ensure_default_model

        a.model = ensure_default_model()
    out = measure(weight_elements(a.model), getattr(torch, a.dtype), a.threads, a.rounds)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
