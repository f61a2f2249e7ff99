"""int8 weights and activations on the CPU (`--quantization int8`; on a GPU the same flag
takes worker/quant_gpu.py's fp8 or int8 tensor-core path).

Each linear weight is quantized once, after loading and sharding (so under tensor
parallelism each rank quantizes its own shard): symmetric, one float scale per
output channel. At every call the activations are quantized per token (one scale
per row, `Kernels.quantize_rows`), the int8 matmul runs on AMX's int8 tiles where the
CPU has them (subway_kernels/csrc/amx_int8_cpu.cpp), else in our AVX-512 VNNI kernel
(subway_kernels/csrc/avx512_int8_cpu.cpp: Zen 4, Ice Lake, Cascade Lake), else in our AVX2
kernel (subway_kernels/csrc/avx2_int8_cpu.cpp), else (no AVX2, VNNI) in oneDNN
(`onednn::qlinear_pointwise` on a prepacked weight), and each output row is scaled back. The lm_head is quantized too, from a smoothed copy (worker/smooth.py moves
activation outliers into the weights first); embeddings, norms and attention stay in
the model's dtype.
"""

from __future__ import annotations

import functools
import platform

import torch

from subway.ipc.config import EngineConfig


@functools.cache
def _cpu_flags() -> str | None:
    """/proc/cpuinfo's text on x86 Linux, else None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def cpu_has_vnni() -> bool:
    """Whether this CPU has int8 dot products (AVX512-VNNI or AVX-VNNI); True off x86 Linux,
    where oneDNN picks its own path. Without them oneDNN's x86 int8 matmul sums pairs of
    products in 16 bits, which saturate: on an AVX2-only CPU a column came out 6% off."""
    flags = _cpu_flags()
    return flags is None or " avx512_vnni" in flags or " avx_vnni" in flags


def onednn_int8() -> bool:
    """Whether oneDNN's int8 matmul is a path here: VNNI (else its sums saturate) and torch
    built with oneDNN's quantized linear."""
    return (
        cpu_has_vnni()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
    )


def avx2_int8_built() -> bool:
    """Whether the C++ kernels have the AVX2 int8 matmul: they are compiled for this CPU
    (-march=native), so wherever it has AVX2 and FMA. Read from the CPU's flags, so that the
    start-up check does not load the kernels; `int8_ops` says so if they did not build."""
    flags = _cpu_flags()
    return flags is not None and " avx2" in flags and " fma" in flags


def unsupported_reason(config: EngineConfig, device: torch.device | None = None) -> str | None:
    """Why `--quantization` / `--kv-cache-dtype` cannot run with this config, or None."""
    quant, kv = config.model.quantization, config.cache.kv_cache_dtype
    if not config.quantized:
        return None
    if device is None:
        want = config.model.device
        cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    else:
        cuda = device.type == "cuda"
    if cuda:  # torch's 8-bit ops (worker/quant_gpu.py), the Triton kernels' 8-bit cache
        if quant != "int8":
            return None
        from subway.worker.quant_gpu import unsupported_model_reason

        return unsupported_model_reason(config.model.path, config.parallel.tensor_parallel_size)
    if quant == "int8":
        # The flags' own conflicts first, then what this machine lacks: the same flags get
        # the same answer on every CPU.
        if not config.model.cpu_ext:
            return "--quantization int8 needs the C++ CPU kernels (drop --no-cpu-ext)"
        if config.model.dtype in ("float16", "half"):
            return "--quantization int8 runs in bfloat16 or float32 (not --dtype float16)"
        if not onednn_int8() and not avx2_int8_built():
            return (
                "--quantization int8 needs a CPU with VNNI (AVX512-VNNI or AVX-VNNI, and torch "
                "built with oneDNN's quantized linear) or with AVX2: without VNNI oneDNN's int8 "
                "matmul saturates its partial sums"
            )
    if kv == "int8" and not config.model.cpu_ext and config.model.kernels != "triton":
        return "--kv-cache-dtype int8 needs the C++ CPU kernels (drop --no-cpu-ext)"
    return None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [out, in]` -> (int8 [out, in], float32 scales [out]): symmetric per output
    channel, q = round(w / s) with s = max|w| / 127 (s = 1 for an all-zero row)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def choose_path(ops: object, in_features: int, want: str = "auto") -> str:
    """Which int8 matmul a weight of `in_features` inputs takes: AMX's tiles where the CPU
    has them, else our AVX-512 VNNI kernel (any `in_features`), else our AVX2 kernel, else
    oneDNN (with VNNI; without, its pairs of products saturate). On Zen 4 one linear on the
    AVX-512 kernel runs 1.2x the AVX2 one's speed at one row (from L3; from memory both go
    at memory's pace) and 2.4-2.8x at 16 and 64 rows, 1.6-2.1x our bfloat16 linear's
    (tools/bench/bench_int8_paths.py). oneDNN comes last: torch's prepacked weight carries
    zero-point compensation but not the s8-by-s8 one, so for our signed activations a CPU
    with VNNI and no AMX (Zen 4, Ice Lake) runs oneDNN's reference matmul, about 1 s for
    64 x 576 x 1536 where the AVX2 kernel takes milliseconds. `want` forces one (tests,
    benchmarks) where it can run."""
    can = {
        "amx": in_features % 64 == 0 and ops.amx_int8_supported(),
        "avx512": ops.avx512_int8_supported(),
        "onednn": onednn_int8(),
        "avx2": in_features % 4 == 0 and ops.avx2_int8_supported(),
    }
    if want == "auto":
        for path in ("amx", "avx512", "avx2", "onednn"):
            if can[path]:
                return path
        raise ValueError(f"no int8 matmul here for {in_features} inputs (no VNNI; AVX2 needs 4n)")
    if not can.get(want, False):
        raise ValueError(f"int8 path {want!r} cannot run here for {in_features} inputs")
    return want


class Int8Linear:
    """One linear layer's int8 weight and the call that uses it.

    `__call__(x [rows, in], bias) -> [rows, out]` in x's dtype: x quantized per row
    (`quantize_rows`), the exact int8 sums, each output times its row's and its
    channel's scale, plus the bias. The weight is held once, packed for its path
    (`choose_path`): as AMX tiles (`amx_int8_cpu.cpp`), AVX-512 strips
    (`avx512_int8_cpu.cpp`) or AVX2 strips (`avx2_int8_cpu.cpp`), whose kernels round each
    output once, the same bits on all three; or as oneDNN's prepacked
    copy, which folds the channel scales in, and `rescale_rows_` then applies the row's.
    """

    def __init__(self, weight: torch.Tensor, ops: object, path: str = "auto") -> None:
        q, scales = quantize_weight(weight)
        self.out_features, self.in_features = q.shape
        self.scales = scales
        self._quantize = ops.quantize_rows
        self._rescale = ops.rescale_rows_
        self.path = choose_path(ops, self.in_features, path)
        self._matmul = {
            "amx": ops.amx_int8_matmul,
            "avx512": ops.avx512_int8_matmul,
            "avx2": ops.avx2_int8_matmul,
            "onednn": torch.ops.onednn.qlinear_pointwise,
        }[self.path]
        pack = {
            "amx": ops.amx_int8_pack,
            "avx512": ops.avx512_int8_pack,
            "avx2": ops.avx2_int8_pack,
        }.get(self.path)
        self.packed = pack(q) if pack is not None else torch.ops.onednn.qlinear_prepack(q, None)
        self.zero_points = (
            torch.zeros(self.out_features, dtype=torch.int64) if self.path == "onednn" else None
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        q, s = self._quantize(x)
        if self.path != "onednn":  # x is bfloat16 or float32, as quantize_rows requires
            b = None if bias is None else bias.to(x.dtype).contiguous()
            return self._matmul(q, s, self.packed, self.scales, b, x.dtype)
        y = self._matmul(
            q, 1.0, 0, self.packed, self.scales, self.zero_points, None,
            1.0, 0, x.dtype, "none", [], "",
        )  # fmt: skip
        return self._rescale(y, s, bias)


def int8_ops() -> object:
    """`torch.ops.subway_int8` (subway_kernels/csrc/quant_cpu.cpp), compiled on first use."""
    from subway.kernels import cpu_ext

    if cpu_ext.load() is None:
        raise RuntimeError("--quantization int8 needs the C++ CPU kernels, which did not build")
    return torch.ops.subway_int8
