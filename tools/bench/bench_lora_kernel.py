"""The batched multi-LoRA kernel (`subway.kernels.lora.lora_apply`, the C++ op of
`subway_kernels/csrc/lora_cpu.cpp`) against a per-adapter loop in PyTorch (`lora_apply_ref`),
alternating rounds in one process.

A fused q/k/v projection's shapes by default (SmolLM2-135M: in 576, out 3 x 576, P = 3),
S adapter slots of rank R; the rows of a step are split into near-equal segments over the
slots (one row: one segment). The op runs with B in both layouts it takes: contiguous
[S, out, R] (`C++ b`), and the transpose of a contiguous [S, R, out] (`C++ bT`, read without
a transpose per call). Each round times `--calls` calls of each of the three in turn; the
table gives the median microseconds per call over the rounds and the median of the rounds'
ratios (the loop's time over the op's).

    python -m subway.tools.bench.bench_lora_kernel [--rounds 7] [--rows 1,16,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from subway.kernels import cpu_ext
from subway.kernels.lora import lora_apply, lora_apply_ref


def _case(rows: int, slots: int, rank: int, in_f: int, out_f: int, parts: int, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    y = torch.randn(rows, out_f, generator=gen).to(dtype)
    a = (torch.randn(slots, parts * rank, in_f, generator=gen) * in_f**-0.5).to(dtype)
    b = (torch.randn(slots, out_f, rank, generator=gen) * 0.01).to(dtype)
    bounds = [out_f * p // parts for p in range(parts + 1)]
    segs = min(rows, slots)
    starts = [rows * g // segs for g in range(segs + 1)]
    seg_start = torch.tensor(starts, dtype=torch.int32)
    seg_slot = torch.arange(segs, dtype=torch.int32)
    return y, x, a, b, bounds, seg_start, seg_slot


def _time(fn, args, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="calls of each per round")
    p.add_argument("--rows", default="1,16,64", help="comma-separated row counts")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--in-features", type=int, default=576)
    p.add_argument("--parts", type=int, default=3)
    p.add_argument("--out-features", type=int, default=576 * 3)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as it is)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if cpu_ext.load() is None:
        raise SystemExit("the C++ CPU kernels did not build: nothing to compare")
    isa = torch.ops.subway_lora.lora_isa()
    print(f"# {isa} build, {torch.get_num_threads()} threads, S={a.slots} R={a.rank} "
          f"in={a.in_features} out={a.out_features} P={a.parts}, {a.rounds} rounds x "
          f"{a.calls} calls")  # fmt: skip
    print("| dtype | rows | C++ b us | C++ bT us | torch loop us | loop / C++ b | loop / C++ bT |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        for rows in (int(r) for r in a.rows.split(",")):
            y, x, aa, b, bounds, seg_start, seg_slot = _case(
                rows, a.slots, a.rank, a.in_features, a.out_features, a.parts, dtype
            )
            b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
            runs = {
                "b": (lora_apply, (y, x, aa, b, bounds, seg_start, seg_slot)),
                "bT": (lora_apply, (y, x, aa, b_t, bounds, seg_start, seg_slot)),
                "ref": (lora_apply_ref, (y, x, aa, b, bounds, seg_start, seg_slot)),
            }
            for fn, args in runs.values():  # warm up
                _time(fn, args, 5)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(a.rounds):
                for k, (fn, args) in runs.items():
                    times[k].append(_time(fn, args, a.calls))
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = {
                k: statistics.median(r / f for r, f in zip(times["ref"], times[k], strict=True))
                for k in ("b", "bT")
            }
            print(f"| {name} | {rows} | {med['b']:.1f} | {med['bT']:.1f} | {med['ref']:.1f} | "
                  f"{ratio['b']:.2f}x | {ratio['bT']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
