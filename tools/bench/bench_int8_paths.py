"""One int8 linear on each CPU path against bfloat16, alternating rounds: the AVX-512 VNNI
kernel (subway_kernels/csrc/avx512_int8_cpu.cpp), the AVX2 one (avx2_int8_cpu.cpp), torch's
bfloat16 `F.linear`, and our bfloat16 linear (`worker.layers.linear`: the few-row kernel up
to `small_linear_rows` rows, else oneDNN's packed matmul).

    python -m subway.tools.bench.bench_int8_paths [--rows 1,16,64] [--rounds 7]

Each int8 call is Int8Linear's, as the model makes it: the rows quantized (quantize_rows),
then the matmul. Each system holds `--copies` copies of the weight and cycles through them,
so that (at the default 8) a call's weight comes from L3 or memory as in a model's step,
not from the L2 the last call left it in. Within a round the systems take turns (the order
reversed every other round); each round's ratios are the other system's time over the
AVX-512 kernel's (above 1: the AVX-512 kernel is faster), reported as the median and the
spread (min-max) over the rounds. Shapes are out x in.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from subway.kernels import cpu_ext
from subway.worker.layers import linear, pack_weight, small_layout, widen_bf16
from subway.worker.quant import Int8Linear, choose_path, int8_ops

SHAPES = "576x1536,1536x576,640x2048"


def _systems(shape: tuple[int, int], copies: int) -> dict[str, Callable]:
    """Each system's call on `x` (rows by in, bfloat16), cycling through its weights."""
    torch.manual_seed(0)
    ws = [(torch.randn(shape) * 0.02).bfloat16() for _ in range(copies)]
    ops, ext = int8_ops(), cpu_ext.load()
    out: dict[str, list[Callable]] = {}
    for path in ("avx512", "avx2"):
        try:
            choose_path(ops, shape[1], path)
        except ValueError:
            continue
        out[path] = [Int8Linear(w, ops, path) for w in ws]
    out["F.linear"] = [lambda x, w=w: F.linear(x, w) for w in ws]
    out["bf16 ours"] = [_ours(w, ext) for w in ws]
    return {name: _cycle(fns) for name, fns in out.items()}


def _ours(w: torch.Tensor, ext: object) -> Callable:
    """Our bfloat16 linear as PackedLinear.matmul runs it (`worker.layers.linear`)."""
    wide = widen_bf16("auto")
    few = ext.small_linear if ext is not None and ext.small_linear_supported() else None
    rows = ext.small_linear_rows() if few is not None else 0
    laid = small_layout(w, ext.small_linear_pack) if few is not None else None
    packed = pack_weight(w.float() if wide else w, 64)
    return lambda x: linear(x, w, None, packed, few, rows, wide, laid)


def _cycle(fns: list[Callable]) -> Callable:
    def call(x: torch.Tensor) -> None:
        for f in fns:
            f(x)

    return call


def _time(fn: Callable, x: torch.Tensor, calls: int, min_s: float) -> float:
    """Seconds per call of `fn(x)` (which makes `calls` calls), over at least `min_s`."""
    n, start = 0, time.perf_counter()
    while True:
        fn(x)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / (n * calls)


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def bench(shape: tuple[int, int], rows: list[int], a: argparse.Namespace) -> None:
    systems = _systems(shape, a.copies)
    names = list(systems)
    for m in rows:
        x = torch.randn(m, shape[1]).bfloat16()
        for fn in systems.values():
            fn(x)  # warm-up
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names if r % 2 == 0 else reversed(names):
                times[n].append(_time(systems[n], x, a.copies, a.min_time))
        med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
        cells = [f"{med[n]:.1f}" for n in names]
        base = times.get("avx512")
        for n in names[1:] if base is not None else []:
            cells.append(_ratio([o / b for o, b in zip(times[n], base, strict=True)]))
        print(f"| {shape[0]}x{shape[1]} | {m} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="out x in, comma-separated")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--copies", type=int, default=8, help="weights cycled through per system")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per system a round")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = [int(r) for r in a.rows.split(",")]
    names = list(_systems((16, 64), 1))
    head = [f"{n} us" for n in names] + [f"{n} / avx512" for n in names[1:] if names[0] == "avx512"]
    print(f"median us per call of {a.rounds} rounds, {a.threads} threads, {a.copies} weight copies;"
          " ratios: the other's time over avx512's, median [min-max]")  # fmt: skip
    print("| shape | rows | " + " | ".join(head) + " |")
    print("|---|---:|" + "---:|" * len(head))
    for shape in shapes:
        bench(shape, rows, a)


if __name__ == "__main__":
    main()
