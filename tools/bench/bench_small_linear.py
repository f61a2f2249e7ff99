"""Decode steps with the few-row bfloat16 linear (`subway_kernels/csrc/gemv_cpu.cpp`; AMX from 5
rows, `amx_linear_cpu.cpp`) against oneDNN's packed matmul, and with every layer in one
compiled call (`fused`: worker/model.py FusedDecode), in one process, alternating rounds.

The default model, bfloat16, 2 threads, offline (`subway.LLM`): for each batch size B, B
requests of 101 prompt tokens decode 60 tokens each per round; the median step of the
last 50 is the figure. Batches past `small_linear_rows` are oneDNN's in every column.
`small_linear` runs the layers' Python loop, `fused` the same kernels from one call.

    python -m subway.tools.bench.bench_small_linear [--rounds 3] [--batches 1,8,16,32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from subway.ipc.messages import SamplingParams
from subway.llm import LLM
from subway.worker.layers import PackedLinear


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1", help="comma-separated batch sizes")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    llm = LLM(dtype="bfloat16", max_num_seqs=64)
    runner = llm.runner
    layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    kernel, fused = layers[0].small, runner.model.fused_decode
    if kernel is None:
        raise SystemExit(
            "no small_linear here (no AVX512-BF16 or AVX2, or the CPU kernels are off)"
        )
    execute = runner.execute
    times: list[float] = []

    def timed(plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = execute(plan)
        times.append(time.perf_counter() - t)
        return out

    runner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for b in (int(x) for x in a.batches.split(",")):
        res: dict[str, list[float]] = {"oneDNN": [], "small_linear": []}
        if fused is not None:
            res["fused"] = []
        for rnd in range(a.rounds):
            for name, per_round in res.items():
                for m in layers:
                    m.small = None if name == "oneDNN" else kernel
                runner.model.lm_head_small = None if name == "oneDNN" else kernel
                runner.model.fused_decode = fused if name == "fused" else None
                times.clear()
                llm.generate([[1, 2, 3, 4, 5] * 20 + [rnd, i] for i in range(b)], params)
                per_round.append(statistics.median(times[-50:]) * 1e3)
        for name, v in res.items():
            print(f"{name:>13}: batch-{b} decode step, median ms per round: "
                  f"{', '.join(f'{x:.2f}' for x in v)}")  # fmt: skip
        ratio = statistics.mean(res["oneDNN"]) / statistics.mean(res["small_linear"])
        print(f"small_linear: {ratio:.3f}x faster per step at batch {b}", flush=True)
        if "fused" in res:
            ratio = statistics.mean(res["small_linear"]) / statistics.mean(res["fused"])
            print(f"fused: {ratio:.3f}x faster per step than small_linear's Python loop at "
                  f"batch {b}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
