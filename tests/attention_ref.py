"""Dense float64 attention and random paged caches: the references that the windowed and
soft-capped kernel tests (test_sliding_window.py, test_gemma2.py) check the kernels against."""

from __future__ import annotations

import numpy as np
import torch

from subway.kernels.attention import dequantize_kv, quantize_kv


def dense_attention(
    q, keys, values, positions, window: int, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """Queries `q [m, H, d]` at `positions` over one sequence's `keys, values [ctx, KVH, d]`,
    in float64: scores scaled, capped (softcap > 0), masked causally and to the window."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("mhd,jhd->hmj", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.as_tensor(positions)[:, None]
    j = torch.arange(keys.shape[0])[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hmj,jhd->mhd", probs, v).float()


def random_caches(dtype, kv_heads, head_dim, block_size, num_blocks, gen, kv_int8):
    """(k, v as the kernel reads them, k, v as float32 values)."""
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    if kv_int8:
        k, v = quantize_kv(k), quantize_kv(v)
        return k, v, dequantize_kv(k, torch.float32), dequantize_kv(v, torch.float32)
    return k, v, k.float(), v.float()


def sequence_kv(kf, vf, table: np.ndarray, ctx: int):
    idx = torch.from_numpy(table.astype(np.int64))
    return kf[idx].flatten(0, 1)[:ctx], vf[idx].flatten(0, 1)[:ctx]
