"""Batched multi-LoRA (`subway.kernels.lora`'s contract) in Triton: Punica's SGMV as two
kernels over the segments of rows.

- shrink: t [rows, P*R] (float32) = x @ a[slot]^T, a program per (segment, block of BLOCK_M
  rows, block of A rows), `in` in steps of BLOCK_K;
- expand: y += t[:, part] @ b[slot, outputs]^T, a program per (segment, block of rows, block
  of BLOCK_N outputs of one part), added to y in float32 and rounded once.

Programs of slot -1, or past the end of their segment, return at once. The block sizes are
fixed (they do not depend on the row count), so a row's sums are the same whatever batch it
is in. t and B are multiplied in float32 ("ieee": no TF32); x and A in their own dtype with
a float32 accumulator (float32 inputs: "ieee" too).

x and y need contiguous rows; a and b any strides (b as the transpose of a [S, R, out], as
the C++ op reads fastest, or contiguous). The segments come as CPU tensors (as for the other
backends): the longest segment, which sizes the grid, is read there, and both go to the
device in one copy (already on the device: the grid covers every row, with no read back).
Up to 4 parts per launch (a fused q/k/v projection is 3); more take a launch per 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program (tl.dot's least)
MAX_PARTS = 4  # parts per expand launch


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    seg_ptr,  # [2G+1] int32: seg_start, then seg_slot
    num_segs,
    base,
    in_features,
    pr,
    stride_x,
    stride_t,
    stride_as,
    stride_ar,
    stride_ak,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0)
    slot = tl.load(seg_ptr + num_segs + 1 + g)
    start = tl.load(seg_ptr + g)
    end = tl.load(seg_ptr + g + 1)
    r0 = start + tl.program_id(1) * BLOCK_M
    if slot < 0 or r0 >= end:
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < end
    cmask = cols < pr
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + ks
        kmask = kk < in_features
        xt = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        at = tl.load(
            a_base + cols[None, :].to(tl.int64) * stride_ar + kk[:, None] * stride_ak,
            mask=cmask[None, :] & kmask[:, None],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    tl.store(
        t_ptr + (rows[:, None] - base).to(tl.int64) * stride_t + cols[None, :],
        acc,
        mask=rmask[:, None] & cmask[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    t_ptr,
    seg_ptr,
    num_segs,
    base,
    rank,
    stride_y,
    stride_t,
    stride_bs,
    stride_bo,
    stride_bj,
    first_part,
    # part q (0..3) of this launch owns outputs lo_q:hi_q and the programs blk_q:blk_{q+1}
    lo0,
    hi0,
    lo1,
    hi1,
    lo2,
    hi2,
    lo3,
    hi3,
    blk1,
    blk2,
    blk3,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    g = tl.program_id(0)
    slot = tl.load(seg_ptr + num_segs + 1 + g)
    start = tl.load(seg_ptr + g)
    end = tl.load(seg_ptr + g + 1)
    r0 = start + tl.program_id(1) * BLOCK_M
    if slot < 0 or r0 >= end:
        return
    nb = tl.program_id(2)
    q = (nb >= blk1).to(tl.int32) + (nb >= blk2).to(tl.int32) + (nb >= blk3).to(tl.int32)
    lo = tl.where(q == 0, lo0, tl.where(q == 1, lo1, tl.where(q == 2, lo2, lo3)))
    hi = tl.where(q == 0, hi0, tl.where(q == 1, hi1, tl.where(q == 2, hi2, hi3)))
    first = tl.where(q == 0, 0, tl.where(q == 1, blk1, tl.where(q == 2, blk2, blk3)))
    cols = lo + (nb - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = r0 + tl.arange(0, BLOCK_M)
    js = tl.arange(0, BLOCK_R)
    rmask = rows < end
    cmask = cols < hi
    jmask = js < rank
    part = first_part + q
    tt = tl.load(
        t_ptr + (rows[:, None] - base).to(tl.int64) * stride_t + part * rank + js[None, :],
        mask=rmask[:, None] & jmask[None, :],
        other=0.0,
    )
    bt = tl.load(
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + cols[None, :].to(tl.int64) * stride_bo
        + js[:, None] * stride_bj,
        mask=cmask[None, :] & jmask[:, None],
        other=0.0,
    ).to(tl.float32)
    delta = tl.dot(tt, bt, input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    ymask = rmask[:, None] & cmask[None, :]
    yv = tl.load(y_ptrs, mask=ymask, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=ymask)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: Sequence[int],
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
) -> None:
    """`subway.kernels.lora.lora_apply` on y's device (CUDA, or the CPU under the interpreter)."""
    assert x.stride(-1) == 1 and y.stride(-1) == 1, "rows of x and y must be contiguous"
    num_segs = seg_slot.shape[0]
    if num_segs == 0:
        return
    rank = b.shape[2]
    parts = len(bounds) - 1
    pr = a.shape[1]
    in_features = x.shape[1]
    out_features = y.shape[1]
    assert pr == parts * rank and a.shape[2] == in_features and b.shape[1] == out_features
    if seg_start.device.type == "cpu":
        starts = seg_start.numpy()
        base, end = int(starts[0]), int(starts[-1])
        longest = int((starts[1:] - starts[:-1]).max())
        seg = torch.cat((seg_start.to(torch.int32), seg_slot.to(torch.int32)))
        seg = seg.to(y.device, non_blocking=True)
    else:  # on the device already: no read back; the grid covers every row
        base, end = 0, y.shape[0]
        longest = y.shape[0]
        seg = torch.cat((seg_start.to(torch.int32), seg_slot.to(torch.int32)))
    if longest <= 0 or end <= base:
        return
    row_blocks = triton.cdiv(longest, BLOCK_M)
    t = torch.empty((end - base, pr), dtype=torch.float32, device=y.device)
    block_n = min(64, max(16, triton.next_power_of_2(pr)))
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    _shrink_kernel[(num_segs, row_blocks, triton.cdiv(pr, block_n))](
        x, a, t, seg, num_segs, base, in_features, pr, x.stride(0), t.stride(0),
        a.stride(0), a.stride(1), a.stride(2),
        IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 64
    for p0 in range(0, parts, MAX_PARTS):
        los, his, blks = [], [], [0]
        for p in range(p0, min(parts, p0 + MAX_PARTS)):
            los.append(bounds[p])
            his.append(bounds[p + 1])
            blks.append(blks[-1] + triton.cdiv(max(0, bounds[p + 1] - bounds[p]), block_n))
        total = blks[-1]
        while len(los) < MAX_PARTS:  # unused parts: empty, no programs
            los.append(0)
            his.append(0)
            blks.append(total)
        if total == 0:
            continue
        _expand_kernel[(num_segs, row_blocks, total)](
            y, b, t, seg, num_segs, base, rank, y.stride(0), t.stride(0),
            b.stride(0), b.stride(1), b.stride(2), p0,
            los[0], his[0], los[1], his[1], los[2], his[2], los[3], his[3],
            blks[1], blks[2], blks[3],
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
        )  # fmt: skip
