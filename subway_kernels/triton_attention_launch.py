"""The host side of `triton_attention.paged_attention`: its argument checks, the grid and
meta-parameters of its launch, chosen from shapes only (no host sync, so that a decode step
can be captured in a CUDA graph), and the launches themselves.

The kernels stay with their `@triton.jit` helpers in `triton_attention`, which passes them
in: this module holds no Triton code.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

import torch
import triton

from subway.kernels.attention import KV_SCALE_BYTES, AttentionMetadata

_LOG2E = 1.4426950408889634


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number, so that the split path is testable
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many programs share one decode sequence's keys: enough to fill the device, from shapes only.

    `max_context` is a host-side bound (the table width times the block size),
    never read from the device.
    """
    programs = num_seqs * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms or max_context < 512:
        return 1
    want = min(-(-2 * sms // programs), max_context // 256, 16)
    return max(1, want)


def check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """Assert the layouts the kernel reads and writes; the output (new where `out` is None)."""
    head_dim = q.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    kv_int8 = k_cache.dtype == torch.int8
    assert k_cache.shape[-1] == head_dim + KV_SCALE_BYTES * kv_int8
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    return out


class AttentionPlan(NamedTuple):
    """One launch of the paged attention kernel: its grid and meta-parameters."""

    grid: tuple[int, int, int]  # (query blocks + sequences, KV heads, splits)
    num_seqs: int
    num_splits: int  # > 1: partials into float32 scratch, then merged
    block_size: int
    group: int  # query heads per KV head
    head_dim: int
    head_dim_p: int
    block_q: int
    block_m: int
    tile_n: int
    precision: str  # tl.dot input precision
    kv_int8: bool


def plan_attention(
    q: torch.Tensor, k_cache: torch.Tensor, md: AttentionMetadata, num_splits: int | None
) -> AttentionPlan:
    """The grid and meta-parameters for `q` over `k_cache`, from shapes only.

    `num_splits` (decode-only batches): None picks from shapes; 1 disables splitting.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = md.context_lens.shape[0]
    if md.all_decode:
        block_m, tile_n = pow2(group, 16), 64
        if num_splits is None:
            width = md.block_tables.shape[1] * block_size
            num_splits = choose_splits(num_seqs, num_kv_heads, width, q.device)
    else:
        block_m, tile_n, num_splits = pow2(group, 64), 32, 1
    block_q = block_m // group
    return AttentionPlan(
        grid=(num_tokens // block_q + num_seqs, num_kv_heads, num_splits),
        num_seqs=num_seqs,
        num_splits=num_splits,
        block_size=block_size,
        group=group,
        head_dim=head_dim,
        head_dim_p=pow2(head_dim, 16),
        block_q=block_q,
        block_m=block_m,
        tile_n=tile_n,
        precision="ieee" if q.dtype == torch.float32 else "tf32",
        kv_int8=k_cache.dtype == torch.int8,
    )


def launch_paged_attention(
    kernels: Sequence,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    num_splits: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`triton_attention.paged_attention` with its `kernels`: (attention, merge of splits)."""
    attention_kernel, merge_kernel = kernels
    out = check_attention_args(q, k_cache, v_cache, out)
    if q.shape[0] == 0:
        return out
    plan = plan_attention(q, k_cache, md, num_splits)
    if plan.num_splits > 1:
        part, lse = _split_scratch(q, plan.num_splits)
        # The split path indexes its scratch itself.
        args = (part, lse, q, k_cache, v_cache, md, scale, (0, 0))
        _launch_attention(attention_kernel, plan, *args)
        _merge_splits(merge_kernel, plan, out, part, lse)
    else:
        args = (out, out, q, k_cache, v_cache, md, scale, (out.stride(0), out.stride(1)))
        _launch_attention(attention_kernel, plan, *args)  # lse: unused
    return out


def _split_scratch(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scratch for the split path's partials: out [T, H, S, D], lse [T, H, S, 2]."""
    num_tokens, num_heads, head_dim = q.shape
    part = torch.empty(
        num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    lse = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    return part, lse


def _launch_attention(
    kernel,
    plan: AttentionPlan,
    target: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out_strides: tuple[int, int],
) -> None:
    kernel[plan.grid](
        target,
        lse,
        q,
        k_cache,
        v_cache,
        md.block_tables,
        md.query_start_loc,
        md.context_lens,
        scale * _LOG2E,
        plan.num_seqs,
        q.shape[1],
        plan.num_splits,
        q.stride(0),
        q.stride(1),
        out_strides[0],
        out_strides[1],
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        md.block_tables.stride(0),
        BLOCK_SIZE=plan.block_size,
        GROUP=plan.group,
        HEAD_DIM=plan.head_dim,
        HEAD_DIM_P=plan.head_dim_p,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        TILE_N=plan.tile_n,
        SPLIT=plan.num_splits > 1,
        PRECISION=plan.precision,
        KV_INT8=plan.kv_int8,
        num_warps=4,
    )


def _merge_splits(
    kernel, plan: AttentionPlan, out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor
) -> None:
    num_tokens, num_heads, _ = out.shape
    kernel[(num_tokens, num_heads)](
        out,
        part,
        lse,
        out.stride(0),
        out.stride(1),
        num_heads,
        plan.num_splits,
        HEAD_DIM=plan.head_dim,
        HEAD_DIM_P=plan.head_dim_p,
        SPLITS_P=pow2(plan.num_splits, 2),
        num_warps=4,
    )
