"""The kernel backend of a model, chosen once when the model is built.

`choose_kernels(mode, cpu_ext, device)` takes `ModelConfig.kernels` and
`ModelConfig.cpu_ext` (`--kernels`, `--no-cpu-ext`) and the model's device, and
returns a frozen `Kernels`: the functions the model calls, already picked.

- `kernels="auto"` (the default): Triton on CUDA (when `triton` imports), the
  PyTorch references everywhere else;
- `kernels="triton"`: Triton on any device (on the CPU this needs
  `TRITON_INTERPRET=1` set before the Triton modules are first imported: tests);
- `kernels="torch"`: the references everywhere (a baseline on CUDA).

With the references on the CPU and `cpu_ext` (the default), the compiled C++
kernels (`cpu_ext`, `subway_kernels/csrc/`) serve decode attention, RMSNorm, rotary
embedding with the KV-cache write, and the bfloat16 linears of one-row steps, where
they apply; where they cannot be built,
the references serve. All three read and write an 8-bit KV cache (`--kv-cache-dtype
int8`, `attention.quantize_kv`'s layout and rounding).

The layers keep the functions they call, so a step does no lookup of the mode,
the environment or the extension. The Triton modules are imported only when
chosen, so a CPU run never imports Triton. Signatures are the references'; the
Triton versions differ only in writing in place where the model does not care
(see `triton_ops`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType

import torch

from subway.kernels import attention as _ref_attention
from subway.kernels import cpu_ext as _cpu_ext
from subway.kernels import ops as _ref_ops

MODES = ("auto", "triton", "torch")


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend(mode: str, device: torch.device | str) -> str:
    """'triton' or 'torch': what `mode` (`ModelConfig.kernels`) runs on `device`."""
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: expected one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


@dataclass(frozen=True)
class Kernels:
    """What the model calls, picked for its device; `name` is 'triton' or 'torch'."""

    name: str
    rms_norm: Callable  # (x, weight, eps, residual=None)
    rope_and_write_kv: Callable  # rotary q and k, k and v into the caches; returns q
    paged_attention: Callable  # (q, k_cache, v_cache, md, scale)
    silu_and_mul: Callable
    # A bfloat16 linear of a few rows (x, w, bias) -> y, faster than oneDNN's at decode
    # batches (`subway_kernels/csrc/gemv_cpu.cpp`, `amx_linear_cpu.cpp` from 5 rows where the CPU
    # has AMX), for the layers that take it; None: none here.
    small_linear: Callable | None = None
    # The weight as small_linear reads it (w) -> w': on AVX2 a copy in its own layout (the
    # same shape), elsewhere w itself.
    small_linear_pack: Callable | None = None
    # Greedy argmax of bfloat16 logits rows without a float32 copy (`argmax_cpu.cpp`); None: none.
    argmax_rows: Callable | None = None
    small_linear_rows: int = 1  # the most rows that small_linear takes
    # Every decoder layer of a decode step in one call (`decode_layers_cpu.cpp`, worker/model.py
    # FusedDecode: up to small_linear_rows rows in bfloat16, any under int8); None: none here.
    decode_layers: Callable | None = None


def choose_kernels(
    mode: str = "auto", cpu_ext: bool = True, device: torch.device | str = "cpu"
) -> Kernels:
    """The kernels for a model on `device`: see the module doc."""
    if backend(mode, device) == "triton":
        attn = importlib.import_module("subway.kernels.triton_attention")
        return _kernels("triton", attn, importlib.import_module("subway.kernels.triton_ops"))
    ext = _cpu_ext.load() if cpu_ext and torch.device(device).type == "cpu" else None
    if ext is None:
        return _kernels("torch", _ref_attention, _ref_ops)
    return _cpu_kernels(ext)


def _kernels(name: str, attn: ModuleType, ops: ModuleType) -> Kernels:
    apply_rope, write_kv = ops.apply_rope, attn.write_kv

    def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
        q, k = apply_rope(q, k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    return Kernels(name, ops.rms_norm, rope_and_write_kv, attn.paged_attention, ops.silu_and_mul)


def _cpu_kernels(ext) -> Kernels:
    """The references, with the compiled CPU ops (`subway_kernels/csrc/`) where they apply."""
    ref = _kernels("torch", _ref_attention, _ref_ops)
    ref_rms_norm, ref_rope_and_write_kv = ref.rms_norm, ref.rope_and_write_kv
    ext_rms_norm, ext_rope_write_kv = ext.rms_norm, ext.rope_write_kv

    def rms_norm(
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = ext_rms_norm(x, residual, weight, eps)
            return out[0] if residual is None else (out[0], out[1])
        return ref_rms_norm(x, weight, eps, residual)

    def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
        """One compiled call (q, k, v may be strided views of the qkv output); it quantizes
        into an int8 cache (`--kv-cache-dtype int8`) as the reference `write_kv` does."""
        if q.dtype == cos_sin_cache.dtype and k_cache.dtype in (q.dtype, torch.int8):
            return ext_rope_write_kv(
                q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
            )
        return ref_rope_and_write_kv(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    ext_silu_and_mul = ext.silu_and_mul if ext.silu_and_mul_supported() else None

    def silu_and_mul(x):
        """bfloat16 rows in one compiled call (the reference's rounding); else the reference."""
        if ext_silu_and_mul is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            return ext_silu_and_mul(x)
        return ref.silu_and_mul(x)

    attention = partial(_ref_attention.paged_attention, ext=ext)  # the decodes compiled
    small = ext.small_linear if ext.small_linear_supported() else None
    return Kernels(
        "torch", rms_norm, rope_and_write_kv, attention, silu_and_mul, small,
        ext.small_linear_pack if small else None, ext.argmax_rows,
        max(1, ext.small_linear_rows()), ext.decode_layers,
    )  # fmt: skip
