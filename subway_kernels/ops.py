"""Elementwise and normalisation ops of the Llama family, as plain PyTorch references.

They compute in the same order as Hugging Face `transformers` so that float32
outputs agree bit for bit where possible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`, first `x = x + residual`.

    Without `residual` returns the normed tensor; with it returns
    `(normed, x + residual)`, the new residual stream.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings (default, or Llama 3 scaling), as HF computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """`[max_positions, head_dim]`: row p is `cat(cos(p * f), sin(p * f))`.

    `f` are the `head_dim / 2` inverse frequencies, computed in float32 as HF
    does; `apply_rope` doubles each half as HF's `cat((freqs, freqs))` does.
    """
    pos = torch.arange(max_positions, dtype=torch.float)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF "rotate_half" rotary embedding of `q [T, Hq, D]` and `k [T, Hk, D]` at `positions [T]`."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` for a merged gate|up projection of width 2n."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
