"""Packed (oneDNN layout, `worker.layers.pack_weight`) against plain `F.linear` on the CPU,
the few-row bfloat16 linear (`Kernels.small_linear`: the stripe kernel, on AVX2 the blocked
one; AMX from 5 rows where the CPU has it; "-" past `small_linear_rows`), and int8 (`--quantization int8`:
`worker.quant.Int8Linear`, activations quantized per row, on the path `choose_path`
picks: AMX, oneDNN with VNNI, else the AVX2 kernel; and the same call on oneDNN beside it
where the CPU has VNNI). Where oneDNN has no native bfloat16 the packed weight is the
float32 copy the engine keeps (`--bf16-matmul auto`, `widen_bf16`).

    python -m subway.tools.bench.bench_linear [--dtype bfloat16] [--threads 2]

The linear layers of 30 SmolLM2-135M decoder layers (qkv 832x576, o 576x576,
gate_up 3072x576, down 576x1536; --layers), each with its own weights so that they come
from memory as in a real step, at several batch sizes; mean of 5 passes (--passes)
after one warm-up pass.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from subway.kernels import cpu_ext
from subway.worker.layers import linear, pack_weight, widen_bf16
from subway.worker.quant import Int8Linear, int8_ops, onednn_int8

SHAPES = [(832, 576), (576, 576), (3072, 576), (576, 1536)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,4,16,64,512")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (the model has 30)")
    p.add_argument("--passes", type=int, default=5, help="timed passes after the warm-up")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    layers = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(a.layers)]
    wide = dtype == torch.bfloat16 and widen_bf16("auto")
    packed = [[pack_weight(w.float() if wide else w, 64) for w in ws] for ws in layers]
    ops = int8_ops()
    ext = cpu_ext.load()
    few = ext.small_linear if ext is not None and ext.small_linear_supported() else None
    few_rows = ext.small_linear_rows() if few is not None else 0
    # The weights as the few-row linear reads them (on AVX2 its own layout).
    laid = (
        [[ext.small_linear_pack(w) for w in ws] for ws in layers]
        if few is not None and dtype == torch.bfloat16
        else []
    )
    int8 = [[Int8Linear(w, ops) for w in ws] for ws in layers]
    # oneDNN's int8 saturates without VNNI: there it is not a path, and not timed.
    int8_dnn = (
        [[Int8Linear(w, ops, "onednn") for w in ws] for ws in layers] if onednn_int8() else None
    )
    print(f"| batch | plain F.linear ms | packed ms | speed-up | int8 ms | int8 vs packed |"
          f" small_linear ms | small vs packed | int8 oneDNN ms | int8 vs int8 oneDNN |"
          f"  ({a.dtype}, {a.threads} threads, int8 on {int8[0][0].path}"
          f"{', bfloat16 packed as float32' if wide else ''})")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in a.batches.split(",")):
        xs = {i: torch.randn(b, i, dtype=dtype) for _, i in SHAPES}

        def plain(xs: dict[int, torch.Tensor] = xs) -> None:
            for ws in layers:
                for w in ws:
                    F.linear(xs[w.shape[1]], w)

        def pk(xs: dict[int, torch.Tensor] = xs) -> None:
            for ws, ps in zip(layers, packed, strict=True):
                for w, pw in zip(ws, ps, strict=True):
                    linear(xs[w.shape[1]], w, None, pw, wide=wide)

        def q8(xs: dict[int, torch.Tensor] = xs, int8: list = int8) -> None:
            for ws, qs in zip(layers, int8, strict=True):
                for w, q in zip(ws, qs, strict=True):
                    q(xs[w.shape[1]])

        def q8_dnn(xs: dict[int, torch.Tensor] = xs) -> None:
            if int8_dnn is not None:
                q8(xs, int8_dnn)

        def sm(xs: dict[int, torch.Tensor] = xs) -> None:
            for ws in laid:
                for w in ws:
                    few(xs[w.shape[1]], w, None)

        fns = [plain, pk, q8, q8_dnn]
        if few is not None and dtype == torch.bfloat16 and b <= few_rows:
            fns.append(sm)
        ms = []
        for fn in fns:
            fn()
            t = time.perf_counter()
            for _ in range(a.passes):
                fn()
            ms.append((time.perf_counter() - t) / a.passes * 1e3)
        small = f" {ms[4]:.1f} | {ms[1] / ms[4]:.2f}x |" if len(ms) > 4 else " - | - |"
        print(
            f"| {b} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[0] / ms[1]:.2f}x | {ms[2]:.1f} "
            f"| {ms[1] / ms[2]:.2f}x |{small} "
            + (f"{ms[3]:.1f} | {ms[3] / ms[2]:.2f}x |" if int8_dnn is not None else "- | - |"),
            flush=True,
        )


if __name__ == "__main__":
    main()
