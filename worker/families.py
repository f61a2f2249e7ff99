"""Which model class runs an architecture's family (`ModelArch.family`), and where."""

from __future__ import annotations

import torch

from subway.kernels.dispatch import Kernels
from subway.worker.gemma import Gemma2CausalLM, Gemma3CausalLM
from subway.worker.model import CausalLM
from subway.worker.model_arch import MOE_FAMILIES, ModelArch
from subway.worker.moe import MoECausalLM
from subway.worker.parallel import TensorParallel


def build_model(
    arch: ModelArch,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    kernels: Kernels,
) -> CausalLM:
    """The model of `arch`'s family, its weights not loaded (`check_kernels` first)."""
    check_kernels(arch, kernels)
    cls = CausalLM
    if arch.family == "gemma3":
        cls = Gemma3CausalLM
    elif arch.family == "gemma2":
        cls = Gemma2CausalLM
    elif arch.family in MOE_FAMILIES:
        cls = MoECausalLM
    return cls(arch, tp, dtype, device, max_positions, kernels)


def check_kernels(arch: ModelArch, kernels: Kernels) -> None:
    """Refuse, at start, a model that `kernels` would run wrong: attention soft-capping
    (Gemma 2) under the Triton kernels, which have none."""
    if arch.attn_softcap and kernels.name == "triton":
        raise ValueError(
            f"attn_logit_softcapping={arch.attn_softcap}: the Triton kernels (CUDA) do not "
            "soft-cap attention scores; run it with --kernels torch or on the CPU"
        )


def resolve_device(name: str, rank: int) -> torch.device:
    """`--device` for tensor-parallel rank `rank` (auto: CUDA if there is one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)
