"""Fused residual-add + RMSNorm, rotary embedding in place, SiLU-and-mul, in Triton.

Same contracts as the references in `subway.kernels.ops`, with two in-place
differences that the model relies on only through return values:

- `rms_norm(x, w, eps, residual)` writes `x + residual` into `residual` and
  returns `(normed, residual)`;
- `apply_rope(q, k, ...)` rotates `q` and `k` in place and returns them.

Rounding follows the references where it matters (the residual sum in the
input dtype, the normed value cast before the weight multiply, SiLU rounded
before the multiply); rotary embedding computes in float32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """`x [..., n]` as a grid of at most two row dims: (rows0, rows1, stride0, stride1)."""
    assert x.stride(-1) == 1, "the last dim must be contiguous"
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"rms_norm takes 1 to 3 dims, got {tuple(x.shape)}")


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    stride_o0,
    stride_o1,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + i * stride_r0 + j * stride_r1 + cols
        x = x + tl.load(r_ptrs, mask=mask, other=0.0)  # rounded to the input dtype, as torch does
        tl.store(r_ptrs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (h * rstd).to(x.dtype) * w
    tl.store(
        out_ptr + i * stride_o0 + j * stride_o1 + cols, y.to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of `x [..., n]` (up to 3 dims, any leading strides).

    With `residual` (same shape): `residual += x` in place, then normalise it;
    returns `(normed, residual)`. `out`: where to write the normed values.
    """
    n = x.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape
    r0, r1, sx0, sx1 = _rows(x)
    _, _, so0, so1 = _rows(out)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        _, _, sr0, sr1 = _rows(residual)
    else:
        sr0 = sr1 = 0
    if r0 * r1:
        block = _pow2(n)
        _rms_norm_kernel[(r0, r1)](
            out,
            x,
            residual if residual is not None else x,
            weight,
            so0,
            so1,
            sx0,
            sx1,
            sr0,
            sr1,
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    return out if residual is None else (out, residual)


@triton.jit
def _rope_rotate(
    ptr, t, stride_t, stride_h, num_heads, cos, sin, HALF: tl.constexpr, HEADS_P: tl.constexpr
):
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    p = ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HEADS_Q_P: tl.constexpr,
    HEADS_K_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_c + d).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + d).to(tl.float32)
    _rope_rotate(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, HEADS_Q_P)
    _rope_rotate(k_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, HALF, HEADS_K_P)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF "rotate_half" rotary embedding of `q [T, Hq, D]`, `k [T, Hk, D]`, in place.

    `cos_sin_cache [max_positions, D]` is `rope_cos_sin_cache`'s: cos half, then sin half.
    `D / 2` must be a power of two (it is for every supported model).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    assert half == triton.next_power_of_2(half), f"head_dim {head_dim}: half must be a power of 2"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q,
            k,
            positions,
            cos_sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            num_q_heads,
            k.shape[1],
            HALF=half,
            HEADS_Q_P=_pow2(num_q_heads),
            HEADS_K_P=_pow2(k.shape[1]),
            num_warps=4,
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_o, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded as F.silu rounds, then the product
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` for a merged gate|up projection `x [rows, 2n]`."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, two_n = x.shape
    n = two_n // 2
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    assert out.shape == (rows, n) and out.stride(-1) == 1
    if rows:
        block = min(_pow2(n), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            out, x, out.stride(0), x.stride(0), n, BLOCK=block, num_warps=4
        )
    return out
