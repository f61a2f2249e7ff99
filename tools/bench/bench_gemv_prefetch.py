"""The few-row linear's software prefetch distance (`gemv_cpu.cpp`, SUBWAY_PREFETCH_BYTES),
swept: one build of the kernel per distance, side by side in one process.

Each build is `gemv_cpu.cpp` alone (AMX left out) compiled with -DSUBWAY_PREFETCH_BYTES=N
(0: no software prefetch). A round times every build over SmolLM2-135M's 121 linear
weights (qkv, o, gate_up, down x 30, and the lm_head; random bfloat16 of those shapes) at
`--rows` rows, then a plain `torch.sum` over as many bytes; the figure is the median round
of `--rounds`, in ms and GB/s. Every build's output is checked equal to the first's (a
prefetch changes no sum).

    python -m subway.tools.bench.bench_gemv_prefetch [--distances 0,4096,12288,24576] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

STUB = """
#include <torch/extension.h>
#include <cstdint>
bool amx_linear_supported() { return false; }
int64_t amx_linear_max_rows() { return 0; }
void amx_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                int64_t) {}
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("small_linear", &small_linear); }
"""
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def build(distance: int, root: str):  # noqa: ANN201 - a compiled module
    from torch.utils import cpp_extension

    from subway.kernels import cpu_ext

    csrc = os.path.join(os.path.dirname(cpu_ext.__file__), "csrc")
    stub = os.path.join(root, "stub.cpp")
    with open(stub, "w") as f:
        f.write(STUB)
    where = os.path.join(root, f"pf{distance}")
    os.makedirs(where, exist_ok=True)
    return cpp_extension.load(
        name=f"subway_gemv_pf{distance}",
        sources=[os.path.join(csrc, "gemv_cpu.cpp"), stub],
        extra_cflags=[
            "-O3",
            "-march=native",
            "-fopenmp",
            "-ffp-contract=off",
            f"-DSUBWAY_PREFETCH_BYTES={distance}",
        ],  # fmt: skip
        extra_ldflags=["-fopenmp"],
        build_directory=where,
        verbose=False,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--distances", default="0,4096,8192,12288,24576,32768")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp(prefix="subway-gemv-")
    builds = {int(d): build(int(d), root) for d in a.distances.split(",")}
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    plain = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    print(f"{len(weights)} weights, {nbytes / 1e6:.0f} MB, {a.threads} threads")
    for rows in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
        first = next(iter(builds.values())).small_linear(xs[576], weights[0], None)
        for m in builds.values():
            assert torch.equal(m.small_linear(xs[576], weights[0], None), first)
        times: dict[str, list[float]] = {f"prefetch {d} B": [] for d in builds}
        times["plain sum"] = []
        for _ in range(a.rounds):
            for d, m in builds.items():
                t = time.perf_counter()
                for w in weights:
                    m.small_linear(xs[w.shape[1]], w, None)
                times[f"prefetch {d} B"].append(time.perf_counter() - t)
            t = time.perf_counter()
            plain.sum()
            times["plain sum"].append(time.perf_counter() - t)
        for name, v in times.items():
            s = statistics.median(v)
            print(f"rows {rows}: {name:>18}: {s * 1e3:7.2f} ms {nbytes / s / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
