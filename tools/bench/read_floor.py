"""The batch-1 weight-read floor: how long one plain read of a model's weights takes here.

A decode step of one sequence reads every weight once, so no step can be faster than one
read of their bytes (in the serving dtype) from memory. This times `torch.sum` over one
tensor of that many bytes on `--threads` threads, as the serving dtype and as float32 (the
median of `--rounds` reads each, after one to warm up), and prints a JSON line: bytes, ms
(the faster of the two), GB/s, and each view's ms. `vs_vllm` runs it before and after
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
from typing import Any

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


def measure(elements: int, dtype: torch.dtype, threads: int, rounds: int) -> dict[str, Any]:
    """The median of `rounds` reads of elements x dtype's bytes, taken two ways, alternating:
    `torch.sum` over them as `dtype` and as float32. The floor is the faster. Where the CPU
    has no bfloat16 arithmetic (AVX2), a bfloat16 sum is bound by widening the values, not by
    the memory: on a 2-core AVX2 EPYC it took 1.1-1.5x as long as reading the same bytes as
    float32, so the floor it gave was that much too high."""
    torch.set_num_threads(threads)
    nbytes = elements * dtype.itemsize
    views = {str(dtype).removeprefix("torch."): torch.ones(elements, dtype=dtype)}
    if dtype != torch.float32:
        views["float32"] = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    times: dict[str, list[float]] = {k: [] for k in views}
    for buf in views.values():
        buf.sum()  # first touch and warm-up
    for _ in range(rounds):
        for k, buf in views.items():
            t = time.perf_counter()
            buf.sum()
            times[k].append(time.perf_counter() - t)
    by_view = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ms = min(by_view.values())
    return {"bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "threads": threads,
            "ms_by_view": by_view}  # fmt: skip


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
