"""Decode attention at head_dim 256 (Gemma 3 270M's heads: 4 query, 1 KV): the compiled fast
path (AVX-512 or AVX2) against the generic C++ kernel that served this size before,
alternated in one process, 5 rounds of 50 calls each.

    python -m subway.tools.bench.bench_head_dim256
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from subway.kernels import cpu_ext


def main() -> None:
    ext = cpu_ext.load()
    if ext is None:
        raise SystemExit("no C++ CPU kernels here: nothing to compare")
    torch.set_num_threads(2)
    bs, num_blocks, heads, kv_heads, d = 16, 2048, 4, 1, 256
    for dtype in (torch.float32, torch.bfloat16):
        for n, ctx in ((1, 512), (16, 512)):
            gen = torch.Generator().manual_seed(0)
            kc = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(dtype)
            vc = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(dtype)
            q = torch.randn(n, heads, d, generator=gen).to(dtype)
            per = ctx // bs
            order = np.random.default_rng(0).permutation(num_blocks)[: n * per]
            tables = torch.from_numpy(order.reshape(n, per).astype(np.int32))
            lens = torch.full((n,), ctx, dtype=torch.int32)

            args = (q, kc, vc, tables, lens, d**-0.5)

            def run(generic: bool, reps: int = 50, args=args) -> float:
                t = time.perf_counter()
                for _ in range(reps):
                    ext.paged_decode(*args, generic)
                return (time.perf_counter() - t) / reps

            run(False, 5), run(True, 5)
            pairs = [(run(False), run(True)) for _ in range(5)]
            ratios = [g / f for f, g in pairs]
            fast = statistics.median(f for f, _ in pairs)
            generic = statistics.median(g for _, g in pairs)
            print(f"{str(dtype)[6:]:9} {n:3} seqs x {ctx}: fast {1e6 * fast:7.1f} us, generic "
                  f"{1e6 * generic:7.1f} us, generic/fast median {statistics.median(ratios):.2f} "
                  f"(spread {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
