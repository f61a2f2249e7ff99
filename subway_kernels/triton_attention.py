"""Paged attention over a flat mixed batch, and KV cache writes, in Triton.

Same contract as `subway.kernels.attention` (its PyTorch reference): `q [num_tokens,
num_heads, head_dim]`; sequence `i` owns tokens `query_start_loc[i] :
query_start_loc[i + 1]`, at positions `context_lens[i] - query_len .. context_lens[i]
- 1`; its keys and values are in the blocks of row `i` of `block_tables`.

One launch serves the whole batch, prefill chunks and decodes alike. A program
takes `BLOCK_Q` query tokens of one sequence times the `GROUP` query heads that
share one KV head (GQA), so that one key tile serves `BLOCK_M = BLOCK_Q * GROUP`
rows of one `tl.dot`. Programs are numbered per sequence without any host sync:
sequence `i` owns programs `query_start_loc[i] // BLOCK_Q + i ..`, and a program
finds its sequence by binary search (as vLLM's unified attention does). The grid
depends on shapes only, so a decode step can be captured in a CUDA graph.

Keys are walked in tiles of `TILE_N` positions; each position looks up its block
in the block table, so any block size works. Causal masking is by position, so a
chunk attends to its cached prefix and causally to itself. Softmax is online
(flash attention), in float32. For small decode batches the keys of a sequence
can be split over `num_splits` programs whose partial results are merged by a
second kernel (flash decoding).

An 8-bit cache (`--kv-cache-dtype int8`: `attention.quantize_kv`'s layout, written as it
writes) is read in place, each int8 tile widened to q's dtype (exact), the key and value
scales applied to the scores and the probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from subway.kernels.attention import KV_SCALE_BYTES, AttentionMetadata
from subway.kernels.triton_attention_launch import choose_splits, launch_paged_attention, pow2

__all__ = ["choose_splits", "paged_attention", "write_kv"]  # choose_splits: imported from here


@triton.jit
def _find_seq(query_start_loc_ptr, program: tl.int32, num_seqs: tl.int32, BLOCK_Q: tl.constexpr):
    """The sequence whose programs include `program`: the last i with qsl[i] // BLOCK_Q + i <= program."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_block(query_start_loc_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence `program` serves, its first query token and query count, and which
    block of `BLOCK_Q` of its query tokens is this program's."""
    seq = _find_seq(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = program - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_len, q_block


@triton.jit
def _query_rows(
    q_block, kv_head, q_len, BLOCK_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr
):
    """Each row of the tile: its query token (within the sequence), its query head, and
    whether it is a real row."""
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # query token within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    return tok, head, row_ok


@triton.jit
def _load_queries(q_ptr, row, head, offs_d, mask, stride_qt, stride_qh):
    """The tile's queries: [BLOCK_M, HEAD_DIM_P]."""
    return tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )


@triton.jit
def _key_tiles(first_pos, last_tok, split, num_splits, TILE_N: tl.constexpr):
    """How many keys the block of queries sees, and which tiles of them are this split's."""
    kv_len = first_pos + last_tok + 1
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    return kv_len, tile_lo, tile_hi


@triton.jit
def _tile_slots(table, t, offs_n, kv_len, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Key tile `t`: its positions, which of them exist, and their cache blocks and offsets."""
    kpos = t * TILE_N + offs_n
    k_ok = kpos < kv_len
    blk = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    off = kpos % BLOCK_SIZE
    return kpos, k_ok, blk, off


@triton.jit
def _load_scales(row_ptr, HEAD_DIM: tl.constexpr, ok):
    """The float32 scale after each int8 vector of an 8-bit cache (0 where not `ok`)."""
    return tl.load((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)


@triton.jit
def _load_keys(k_row, offs_d, d_ok, k_ok):
    """A tile's keys, transposed for the scores' dot: [HEAD_DIM_P, TILE_N]."""
    return tl.load(k_row[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)


@triton.jit
def _load_values(v_row, offs_d, d_ok, k_ok):
    """A tile's values: [TILE_N, HEAD_DIM_P]."""
    return tl.load(v_row[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _scores(
    q,
    k,
    k_row,
    k_ok,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    """The tile's scores, scaled to log2 units."""
    if KV_INT8:  # each key's scale on its scores
        k_scale = _load_scales(k_row, HEAD_DIM, k_ok) * scale_log2
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * k_scale[None, :]
    else:
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    return s


@triton.jit
def _causal_mask(s, kpos, q_pos, k_ok):
    """-inf for a key after its query's position (causal by position) or past the keys."""
    return tl.where((kpos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's step of the online softmax (base 2): the new running max, the tile's
    probabilities, the factor that rescales what came before, and the new running sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, p, alpha, l_i


@triton.jit
def _accumulate(
    acc,
    alpha,
    p,
    v,
    v_row,
    k_ok,
    q,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    """The running output, rescaled, plus the tile's probabilities times its values."""
    if KV_INT8:  # each value's scale on its probabilities
        pv = (p * _load_scales(v_row, HEAD_DIM, k_ok)[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v.to(q.dtype), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc


@triton.jit
def _store_normalised(out_ptr, acc, l_i, row, head, offs_d, o_mask, stride_ot, stride_oh):
    """The output rows: the accumulated values over the softmax's sum, in out's dtype."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=o_mask,
    )


@triton.jit
def _store_partials(
    out_ptr, lse_ptr, base, acc, m_i, l_i, offs_d, o_mask, row_ok, HEAD_DIM: tl.constexpr
):
    """Unnormalised partials: out [T, H, S, D] and lse [T, H, S, 2], both contiguous."""
    tl.store(out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=o_mask)
    tl.store(lse_ptr + base * 2, m_i, mask=row_ok)
    tl.store(lse_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D], or the split scratch [T, H, S, D] (float32)
    lse_ptr,  # split scratch [T, H, S, 2] (float32: max, sum); unused without splits
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    num_splits,  # programs per (query block, KV head) along the keys; > 1 only with SPLIT
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # positions per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16)
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two (>= 16)
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,  # write unnormalised partials for _merge_splits_kernel
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" for exact float32)
    KV_INT8: tl.constexpr,  # the caches are 8-bit: int8 vectors, each with its float32 scale
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, q_block = _query_block(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    first_pos = ctx - q_len  # position of the sequence's first query token
    tok, head, row_ok = _query_rows(q_block, kv_head, q_len, BLOCK_Q, GROUP, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = _load_queries(
        q_ptr, row, head, offs_d, row_ok[:, None] & d_ok[None, :], stride_qt, stride_qh
    )
    q_pos = first_pos + tok
    # Keys this block of queries can see: up to its last query's position.
    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len, tile_lo, tile_hi = _key_tiles(first_pos, last_tok, split, num_splits, TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        kpos, k_ok, blk, off = _tile_slots(table, t, offs_n, kv_len, BLOCK_SIZE, TILE_N)
        k_row = k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh
        k = _load_keys(k_row, offs_d, d_ok, k_ok)
        s = _scores(q, k, k_row, k_ok, scale_log2, HEAD_DIM, PRECISION, KV_INT8)
        s = _causal_mask(s, kpos, q_pos, k_ok)
        m_new, p, alpha, l_i = _online_softmax(s, m_i, l_i)
        v_row = v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh
        v = _load_values(v_row, offs_d, d_ok, k_ok)
        acc = _accumulate(acc, alpha, p, v, v_row, k_ok, q, HEAD_DIM, PRECISION, KV_INT8)
        m_i = m_new

    o_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        _store_normalised(out_ptr, acc, l_i, row, head, offs_d, o_mask, stride_ot, stride_oh)
    else:
        base = (row * num_heads + head) * num_splits + split
        _store_partials(out_ptr, lse_ptr, base, acc, m_i, l_i, offs_d, o_mask, row_ok, HEAD_DIM)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_ptr,  # [T, H, S, D] float32
    lse_ptr,  # [T, H, S, 2] float32
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    base = (t.to(tl.int64) * num_heads + h) * num_splits + offs_s
    m = tl.load(lse_ptr + base * 2, mask=s_ok, other=float("-inf"))
    ell = tl.load(lse_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    # A split past a short sequence's keys saw nothing (l = 0): it gets no weight.
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (ell > 0.0), tl.exp2(m - m_max), 0.0)
    part = tl.load(
        part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    num = tl.sum(tl.where(w[:, None] > 0.0, part * w[:, None], 0.0), 0)
    den = tl.sum(w * tl.where(w > 0.0, ell, 0.0), 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q [num_tokens, num_heads, head_dim]` over the paged caches; same shape out.

    `num_splits` (decode-only batches): None picks from shapes; 1 disables splitting.
    `out`: where to write (q's shape and dtype, last dim contiguous); new by default.
    """
    # Read from this module at each call: gpu_check records launches by swapping them.
    kernels = (_paged_attention_kernel, _merge_splits_kernel)
    return launch_paged_attention(kernels, q, k_cache, v_cache, md, scale, num_splits, out)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,  # quantize each head vector (quantize_kv), its scale after it
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding (a CUDA graph's unused rows): write nothing
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch
    if KV_INT8:
        _store_quantized(kc, k, d, mask, h < NUM_KV_HEADS, HEAD_DIM)
        _store_quantized(vc, v, d, mask, h < NUM_KV_HEADS, HEAD_DIM)
    else:
        tl.store(kc + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized(row_ptr, x, d, mask, head_ok, HEAD_DIM: tl.constexpr):
    """`x [heads, d]` into the int8 rows at `row_ptr [heads, 1]` as quantize_kv writes."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    # Divisions rounded to nearest (div_rn: the GPU's `/` is not), then half to even (as
    # torch.round: adding and taking away 1.5 * 2**23 rounds a float32 below 2**22).
    scale = tl.math.div_rn(tl.max(tl.abs(xf), 1), 127.0)  # [heads]
    y = tl.math.div_rn(xf, tl.where(scale > 0.0, scale, 1.0)[:, None])
    y = (y + 12582912.0) - 12582912.0
    y = tl.where(scale[:, None] > 0.0, tl.minimum(tl.maximum(y, -127.0), 127.0), 0.0)
    tl.store(row_ptr + d, y.to(tl.int8), mask=mask)
    tl.store((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale[:, None], mask=head_ok)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `k, v [tokens, kv_heads, head_dim]` at their slots (quantized into an int8
    cache); a negative slot is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    kv_int8 = k_cache.dtype == torch.int8
    assert k_cache.shape[-1] == head_dim + KV_SCALE_BYTES * kv_int8
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=pow2(num_kv_heads),
        HEAD_DIM_P=pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        KV_INT8=kv_int8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
