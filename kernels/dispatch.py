"""One small switch between the Triton kernels and their PyTorch references.

The model calls the functions of this module; each picks, per call, from the
device of its first tensor:

- `SUBWAY_KERNELS=auto` (the default): Triton on CUDA (when `triton` imports),
  the PyTorch reference everywhere else;
- `SUBWAY_KERNELS=triton`: Triton on any device (on the CPU this needs
  `TRITON_INTERPRET=1` set before the Triton modules are first imported: tests);
- `SUBWAY_KERNELS=torch`: the references everywhere (a baseline on CUDA).

The Triton modules are imported only when first chosen, so a CPU run never
imports Triton. Signatures are the references'; the Triton versions differ only
in writing in place where the model does not care (see `triton_ops`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import cache
from types import ModuleType

import torch

from subway.kernels import attention as _ref_attention
from subway.kernels import cpu_ext
from subway.kernels import ops as _ref_ops
from subway.kernels.attention import AttentionMetadata

ENV = "SUBWAY_KERNELS"
MODES = ("auto", "triton", "torch")


def mode() -> str:
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend(device: torch.device | str) -> str:
    """'triton' or 'torch': what the kernels below run for tensors on `device`."""
    m = mode()
    if m != "auto":
        return m
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def _use_triton(x: torch.Tensor) -> bool:
    m = os.environ.get(ENV)
    if not m or m == "auto":
        return x.is_cuda and triton_available()
    return backend(x.device) == "triton"


def _cpu(x: torch.Tensor):
    """The compiled CPU ops (`kernels/csrc/ops_cpu.cpp`) for a CPU tensor, else None."""
    return cpu_ext.load() if x.device.type == "cpu" else None


def _attention() -> ModuleType:
    return importlib.import_module("subway.kernels.triton_attention")


def _ops() -> ModuleType:
    return importlib.import_module("subway.kernels.triton_ops")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if _use_triton(q):
        return _attention().paged_attention(q, k_cache, v_cache, md, scale)
    return _ref_attention.paged_attention(q, k_cache, v_cache, md, scale)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if _use_triton(k):
        return _attention().write_kv(k, v, k_cache, v_cache, slot_mapping)
    return _ref_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return _ops().rms_norm(x, weight, eps, residual)
    ext = _cpu(x)
    if ext is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        out = ext.rms_norm(x, residual, weight, eps)
        return out[0] if residual is None else (out[0], out[1])
    return _ref_ops.rms_norm(x, weight, eps, residual)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(q):
        return _ops().apply_rope(q, k, positions, cos_sin_cache)
    return _ref_ops.apply_rope(q, k, positions, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        return _ops().silu_and_mul(x)
    return _ref_ops.silu_and_mul(x)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`apply_rope` then `write_kv` of the rotated k and v; returns the rotated q.

    On the CPU one compiled call does both (q, k, v may be strided views of the qkv output).
    """
    ext = None if _use_triton(q) else _cpu(q)
    if ext is not None and q.dtype == k_cache.dtype == cos_sin_cache.dtype:
        return ext.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q, k = apply_rope(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q
