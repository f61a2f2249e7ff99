"""The CPU decode-attention kernel against the PyTorch reference, side by side.

    python -m subway.tools.bench.bench_decode_kernel [--without-avx512 BUILD_DIR] [--layers 30]

`--without-avx512`: the kernels built again into BUILD_DIR with `-mno-avx512f`,
so that a machine with AVX-512 measures the AVX2 path that CPUs without it take.
64 decodes with SmolLM2-135M's heads (9 query, 3 KV, head dim 64), block size
16, one layer's cache; contexts either mixed (1 to 300 tokens, random block
tables) or all 257 tokens. Median of 10 calls each, same inputs, same process.
Then a whole step's attention (`--layers` layers, each with its own cache, from
memory) against a plain read of as many bytes (`against_a_plain_read`).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np
import torch

from subway.kernels import cpu_ext
from subway.kernels.attention import build_metadata, decode_attention_torch, positions_and_slots


def median_ms(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[n // 2]


def against_a_plain_read(ext, layers: int, rounds: int = 5) -> None:
    """A whole step's decode attention (64 x 257 tokens, bfloat16, `layers` layers with their
    own caches, so that the KV comes from memory as in a real step) against `torch.sum` over
    a float32 tensor of the same bytes, interleaved, the median of `rounds`: how close the
    kernel reads its KV to the rate at which this machine streams memory."""
    n, heads, kv_heads, d, bs, ctx = 64, 9, 3, 64, 16, 257
    per_seq = -(-ctx // bs)
    rng = np.random.default_rng(1)
    tables = torch.from_numpy(rng.permutation(n * per_seq).astype(np.int32).reshape(n, per_seq))
    lens = torch.full((n,), ctx, dtype=torch.int32)
    q = torch.randn(n, heads, d, dtype=torch.bfloat16)
    shape = (n * per_seq, bs, kv_heads, d)
    caches = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
              for _ in range(layers)]  # fmt: skip
    read = n * ctx * kv_heads * d * 2 * 2 * layers  # the bytes of K and V the step reads
    plain = torch.randn(read // 4)

    def step() -> None:
        for kc, vc in caches:
            ext.paged_decode(q, kc, vc, tables, lens, 0.125)

    step(), plain.sum()
    kernel_s, sum_s = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        step()
        kernel_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        plain.sum()
        sum_s.append(time.perf_counter() - t)
    k, r = sorted(kernel_s)[rounds // 2], sorted(sum_s)[rounds // 2]
    print(f"\n{layers} layers' caches, 64 x 257 tokens, bfloat16 ({read / 1e6:.0f} MB of K and V), "
          f"median of {rounds} interleaved rounds:")  # fmt: skip
    print("| | ms | GB/s |")
    print("|---|---:|---:|")
    print(f"| decode attention | {1e3 * k:.1f} | {read / k / 1e9:.1f} |")
    print(f"| torch.sum of as many bytes | {1e3 * r:.1f} | {read / r / 1e9:.1f} |")
    print(f"the kernel reads at {r / k:.0%} of the plain read's rate")


def build_without_avx512(directory: str):
    from torch.utils import cpp_extension

    csrc = os.path.join(os.path.dirname(cpu_ext.__file__), "csrc")
    os.makedirs(directory, exist_ok=True)
    return cpp_extension.load(
        name="subway_cpu_kernels_avx2", sources=[os.path.join(csrc, f) for f in cpu_ext.SOURCES],
        extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"], build_directory=directory,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--without-avx512", default="", metavar="BUILD_DIR")
    p.add_argument("--layers", type=int, default=30, help="for the whole-step read (0: skip it)")
    a = p.parse_args(argv)
    ext = build_without_avx512(a.without_avx512) if a.without_avx512 else cpu_ext.load()
    if ext is None:
        raise SystemExit("the CPU kernel could not be built here")
    path = "AVX-512" if ext.has_avx512() else "AVX2" if ext.has_avx2() else "generic"
    print(f"fast path: {path}, {torch.get_num_threads()} threads")
    n, heads, kv_heads, d, bs, num_blocks = 64, 9, 3, 64, 16, 2048
    rng = np.random.default_rng(0)
    print("| contexts | dtype | compiled kernel ms | its generic loop ms | PyTorch reference ms "
          "| speed-up on the loop | on the reference |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for label in ("mixed 1-300", "all 257"):
        ctx = rng.integers(1, 300, n) if label.startswith("mixed") else np.full(n, 257)
        max_blocks = int(-(-ctx.max() // bs))
        order = rng.permutation(num_blocks) if label.startswith("mixed") else np.arange(num_blocks)
        tables = order[: n * max_blocks].reshape(n, max_blocks).astype(np.int32)
        qlens = np.ones(n, dtype=np.int64)
        _, slots = positions_and_slots(qlens, ctx, tables, bs)
        md = build_metadata(qlens, ctx, tables, slots, bs, torch.device("cpu"))
        for dtype in (torch.bfloat16, torch.float32):
            kc = torch.randn(num_blocks, bs, kv_heads, d, dtype=dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(n, heads, d, dtype=dtype)
            lens = torch.from_numpy(ctx.astype(np.int32))
            table_t = torch.from_numpy(tables)
            ours = median_ms(partial(ext.paged_decode, q, kc, vc, table_t, lens, 0.125))
            loop = median_ms(partial(ext.paged_decode, q, kc, vc, table_t, lens, 0.125, True))
            ref = median_ms(partial(decode_attention_torch, q, kc, vc, md, 0.125))
            name = str(dtype).removeprefix("torch.")
            print(f"| {label} | {name} | {ours:.2f} | {loop:.2f} | {ref:.2f} | {loop / ours:.1f}x "
                  f"| {ref / ours:.1f}x |")  # fmt: skip
    if a.layers > 0:
        against_a_plain_read(ext, a.layers)


if __name__ == "__main__":
    main()
