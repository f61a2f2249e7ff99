"""8-bit linear weights on a GPU (`--quantization int8` where the device is CUDA).

The CPU path (worker/quant.py) runs our own int8 kernels; a GPU has 8-bit tensor cores
that torch already drives, so here each linear is two of torch's ops around them:
- `fp8` (Hopper-class GPUs, compute capability 9.0 and up): weights in float8 e4m3, one
  scale per output channel; each call quantizes x to e4m3 with one scale per row, and
  `torch._scaled_mm` multiplies and applies both scales (rowwise scaling).
- `int8` (other CUDA GPUs): weights symmetric int8 per output channel (quant.py's
  `quantize_weight`), x per row on each call, `torch._int_mm`'s exact int32 sums, then
  the two scales.

Both run on the CPU too, which is how the tests check them where no GPU is lent; the
engine uses this class only on CUDA (the runner's `quantize_int8(None)`, which
`PackedLinear.quantize` takes as "no CPU kernels"). The lm_head, embeddings, norms and
attention stay in the model's dtype. Every op is capturable in a CUDA graph: nothing here
reads a value back to the host.
"""

from __future__ import annotations

import torch

from subway.worker.quant import quantize_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# Relative (Frobenius) error against float32 on Gaussian data that each path must stay
# under: tests/test_quant_gpu.py measured at most 0.034 (fp8: 3 mantissa bits) and 0.011
# (int8); tools/gpu_check.py holds the GPU to the same.
ERROR_BOUND = {"fp8": 0.05, "int8": 0.02}
# torch._int_mm on CUDA takes more than 16 rows: fewer are padded with zero rows to this many.
INT_MM_MIN_ROWS = 17


def gpu_path(device: torch.device) -> str:
    """'fp8' where the GPU has fp8 tensor cores with rowwise scaling (sm90+), else 'int8'."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return "fp8"
    return "int8"


def unsupported_gpu_reason(in_features: int, out_features: int) -> str | None:
    """Why a weight of this shape cannot take the 8-bit ops, or None: both dimensions must
    be multiples of 16 (_scaled_mm's and _int_mm's tiles)."""
    if in_features % 16 or out_features % 16:
        return f"a {out_features}x{in_features} weight: 8-bit GPU matmuls need multiples of 16"
    return None


def unsupported_model_reason(path: str, tp: int) -> str | None:
    """Why the model at `path`, split over `tp` ranks, has a linear the 8-bit GPU ops cannot
    take, or None (also where its config cannot be read: loading will say why)."""
    from subway.worker.model_arch import load_model_arch

    try:
        a = load_model_arch(path)
    except (OSError, ValueError):
        return None
    kv_heads = max(1, a.num_kv_heads // tp)  # replicated where there are fewer than ranks
    qkv = (a.num_heads // tp + 2 * kv_heads) * a.head_dim
    shapes = ((a.hidden_size, qkv), (a.num_heads // tp * a.head_dim, a.hidden_size),
              (a.hidden_size, 2 * a.intermediate_size // tp),
              (a.intermediate_size // tp, a.hidden_size))  # fmt: skip
    for k, n in shapes:
        reason = unsupported_gpu_reason(k, n)
        if reason is not None:
            return f"--quantization int8 on a GPU: {reason} (tensor parallel {tp})"
    return None


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (e4m3 [rows, in], float32 scales [rows, 1]): each row's largest |x|
    mapped to 448 (scale 1 for an all-zero row)."""
    xf = x.float()
    scales = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (xf / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


class ScaledLinear:
    """One linear layer's 8-bit weight and the call that uses it: `__call__(x [rows, in],
    bias) -> [rows, out]` in x's dtype. The weight is held transposed ([in, out]), as both
    matmuls take their second operand; the float weight is not kept."""

    def __init__(self, weight: torch.Tensor, path: str = "auto") -> None:
        self.out_features, self.in_features = weight.shape
        reason = unsupported_gpu_reason(self.in_features, self.out_features)
        if reason is not None:
            raise ValueError(reason)
        self.path = gpu_path(weight.device) if path == "auto" else path
        if self.path not in ("fp8", "int8"):
            raise ValueError(f"unknown 8-bit GPU path {self.path!r}")
        # Per output channel, as each call quantizes x per row.
        quantize = quantize_rows_fp8 if self.path == "fp8" else quantize_weight
        q, scales = quantize(weight.detach())
        # [in, out]: for _scaled_mm column major (a view of the [out, in] rows), as it
        # requires; for _int_mm row major, as cuBLAS's int8 path has given wrong sums for a
        # transposed view (torchao's safe_int_mm makes it contiguous for that reason).
        self.weight_t = q.t() if self.path == "fp8" else q.t().contiguous()
        self.scales = scales.view(1, -1).float()  # one per output channel

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        if self.path == "fp8":
            q, s = quantize_rows_fp8(x)
            y = torch._scaled_mm(
                q, self.weight_t, scale_a=s, scale_b=self.scales, out_dtype=torch.bfloat16
            ).to(x.dtype)
        else:
            q, s = quantize_weight(x)  # symmetric int8 per row, as the weight's channels
            s = s[:, None]
            rows = q.shape[0]
            if rows < INT_MM_MIN_ROWS:  # on every device, so that the CPU's tests run it
                q = torch.cat([q, q.new_zeros(INT_MM_MIN_ROWS - rows, q.shape[1])])
            sums = torch._int_mm(q, self.weight_t)[:rows]
            y = (sums.float() * self.scales * s).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)
