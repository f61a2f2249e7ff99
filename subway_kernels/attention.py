"""Paged attention over a flat mixed batch, and KV cache writes: the PyTorch references.

Layout. All scheduled tokens of a step are packed into one `[num_tokens, heads,
head_dim]` tensor. Sequence `i` owns tokens `query_start_loc[i] :
query_start_loc[i + 1]`, which are its positions `context_lens[i] - query_len ..
context_lens[i] - 1`; the KV cache already holds (or, after `write_kv`, holds)
all `context_lens[i]` positions, in the blocks named by row `i` of
`block_tables`. A KV cache is `[num_blocks, block_size, num_kv_heads,
head_dim]`; slot `s` is block `s // block_size`, offset `s % block_size`.
An 8-bit cache (`--kv-cache-dtype int8`) is int8 `[..., head_dim + KV_SCALE_BYTES]`:
each slot and head holds its quantized vector, then that vector's float32 scale
(`quantize_kv`); readers dequantize what they read (`dequantize_kv`).

Decodes (one query token) are batched into one gather and two matmuls, padded
to the longest decode context and masked. Prefill chunks are computed one
sequence at a time, causally over their cached prefix and themselves.

Sliding windows (`window=W` to `paged_attention`): a query at position i attends to
key j iff j <= i and i - j < W (transformers' `sliding_window_overlay`). The step's
metadata holds a `WindowMetadata` per window size of the model (`build_metadata`'s
`windows`), built once and shared by every layer of that window: a decode's block
table row starts at the block of its first key in the window (`first_block`), its
context length counts from there, and `skip` is how many keys of that block lie
before the window; a prefill chunk reads from the first block any of its queries
needs, under a causal and windowed mask. Layers without a window read the plain
fields, as before. (Pages wholly before every window of their group go back to the pool:
hybrid KV groups, `ipc/kv_groups.py`; a table holds block 0 in their place, never read.)

Soft-capping (`softcap=C` to `paged_attention`, Gemma 2's `attn_logit_softcapping`; 0:
none): the scaled scores become C * tanh(score / C) before the mask and the softmax, as
transformers' eager attention computes them. The decodes are capped by the reference and
by the compiled kernels (their `softcap`); a prefill chunk, which PyTorch's SDPA cannot
cap, is then computed explicitly (`_capped_attention`), and by SDPA as before without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lives; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of every new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    # Dispatch for the reference kernel (host-side, so no device syncs):
    decode_seqs: torch.Tensor  # [num_decodes] int64: indices of one-token sequences
    decode_tokens: torch.Tensor  # [num_decodes] int64: their token index in the batch
    decode_max_blocks: int  # blocks that cover the longest decode context
    decode_pad: torch.Tensor  # [num_decodes, decode_max_blocks * block_size] bool: past the context
    prefills: list[tuple[int, int, int, int]]  # (seq index, query start, query len, context len)
    prefill_masks: list[torch.Tensor | None]  # per prefill: [qlen, ctx] bool, None when no prefix
    all_decode: bool  # every sequence is a decode and tokens are in sequence order
    # Per sliding window size of the model (`window=W` layers): what those layers read.
    windows: dict[int, WindowMetadata] = field(default_factory=dict)
    # Hybrid KV groups (ipc/kv_groups.py): each layer's own group's metadata (None: this one).
    per_layer: list[AttentionMetadata] | None = None


@dataclass
class WindowMetadata:
    """A step's decodes and prefill chunks as the layers of one sliding window read them
    (see the module doc); built once per step by `build_metadata`."""

    decode_tables: torch.Tensor  # [num_decodes, blocks] int32: rows from the first block
    decode_lens: torch.Tensor  # [num_decodes] int32: context lengths counted from that block
    decode_skip: torch.Tensor | None  # [num_decodes] int32: its keys before the window; None: 0
    decode_pad: torch.Tensor  # [num_decodes, blocks * block_size] bool: outside the window
    prefills: list[tuple[int, torch.Tensor | None]]  # per prefill: first block, [qlen, keys] mask
    decode_cols: np.ndarray | None = None  # host: the table columns `decode_tables` took


def build_metadata(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device | str,
    windows: tuple[int, ...] = (),
) -> AttentionMetadata:
    """Metadata from host arrays: per sequence its query length, context length, block table row.

    `slot_mapping` comes from `positions_and_slots`, which the caller also
    needs for the positions. `windows`: the model's sliding window sizes (`CausalLM.windows`,
    empty without any), each given its `WindowMetadata`.
    """
    num_seqs = len(query_lens)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    is_decode = query_lens == 1
    dec = np.flatnonzero(is_decode)
    all_decode = len(dec) == num_seqs
    prefills = [
        (int(i), int(qsl[i]), int(query_lens[i]), int(context_lens[i]))
        for i in np.flatnonzero(~is_decode)
    ]
    max_blocks = -(-int(context_lens[dec].max()) // block_size) if len(dec) else 0
    decode_pad = np.arange(max_blocks * block_size)[None, :] >= context_lens[dec][:, None]
    prefill_masks = [_chunk_mask(qlen, ctx, device) for _, _, qlen, ctx in prefills]

    def to(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    windowed = {
        w: _window_metadata(w, context_lens[dec], block_tables[dec], prefills, prefill_masks,
                            block_size, to)
        for w in windows
    }  # fmt: skip
    return AttentionMetadata(
        slot_mapping=to(slot_mapping, torch.int64),
        query_start_loc=to(qsl, torch.int32),
        context_lens=to(context_lens, torch.int32),
        block_tables=to(block_tables, torch.int32),
        decode_seqs=to(dec, torch.int64),
        decode_tokens=to(qsl[dec], torch.int64),
        decode_max_blocks=max_blocks,
        decode_pad=to(decode_pad, torch.bool),
        prefills=prefills,
        prefill_masks=prefill_masks,
        all_decode=all_decode,
        windows=windowed,
    )


def _window_metadata(
    window: int,
    dec_ctx: np.ndarray,
    dec_tables: np.ndarray,
    prefills: list[tuple[int, int, int, int]],
    prefill_masks: list[torch.Tensor | None],
    block_size: int,
    to: Callable[[np.ndarray, torch.dtype], torch.Tensor],
) -> WindowMetadata:
    """One window's view of a step: the decodes' shifted rows (`dec_ctx`, `dec_tables`: the
    decodes' context lengths and block table rows) and each prefill's first block and mask."""
    start = np.maximum(dec_ctx - window, 0)  # a decode's first key in the window
    first = start // block_size
    lens = dec_ctx - first * block_size
    skip = start - first * block_size
    blocks = -(-int(lens.max()) // block_size) if len(lens) else 0
    width = max(dec_tables.shape[1], 1)
    cols = np.minimum(first[:, None] + np.arange(blocks)[None, :], width - 1)  # pad: any block
    tables = np.take_along_axis(dec_tables, cols, axis=1) if dec_tables.size else cols
    keys = np.arange(blocks * block_size)[None, :]
    pad = (keys < skip[:, None]) | (keys >= lens[:, None])
    windowed = []
    for (_, _, qlen, ctx), mask in zip(prefills, prefill_masks, strict=True):
        if ctx <= window:  # no query of the chunk reaches past the window: as without one
            windowed.append((0, mask))
            continue
        first_block = max(0, ctx - qlen - window + 1) // block_size
        k = np.arange(first_block * block_size, ctx)[None, :]
        q = np.arange(ctx - qlen, ctx)[:, None]
        windowed.append((first_block, to((k <= q) & (q - k < window), torch.bool)))
    return WindowMetadata(
        decode_tables=to(tables, torch.int32),
        decode_lens=to(lens, torch.int32),
        decode_skip=to(skip, torch.int32) if skip.any() else None,
        decode_pad=to(pad, torch.bool),
        prefills=windowed,
        decode_cols=cols,
    )


def with_tables(md: AttentionMetadata, tables: np.ndarray, slots: np.ndarray) -> AttentionMetadata:
    """`md` over other block tables: the same rows, windows and masks, `tables`' blocks and
    `slots` (another KV group's pages: worker/kv_pages.py). CPU only (it reads
    `decode_seqs` on the host)."""
    dec = md.decode_seqs.numpy()
    windows = {}
    for w, wm in md.windows.items():
        rows = tables[dec]
        t = np.take_along_axis(rows, wm.decode_cols, axis=1) if rows.size else wm.decode_cols
        windows[w] = replace(wm, decode_tables=torch.from_numpy(t.astype(np.int32)))
    return replace(
        md,
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        block_tables=torch.from_numpy(tables.astype(np.int32)),
        windows=windows,
        per_layer=None,
    )


def _chunk_mask(qlen: int, ctx: int, device: torch.device | str) -> torch.Tensor | None:
    """`[qlen, ctx]` causal mask of a chunk that ends a context; None without a cached prefix."""
    if qlen == ctx:
        return None
    mask = np.arange(ctx)[None, :] <= np.arange(ctx - qlen, ctx)[:, None]
    return torch.from_numpy(mask).to(device)


def positions_and_slots(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Position and cache slot of every token of the flat batch, vectorised (no Python loop)."""
    query_start = np.cumsum(query_lens) - query_lens
    num_tokens = int(query_lens.sum())
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    first_pos = (context_lens - query_lens).astype(np.int64)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
        first_pos - query_start, query_lens
    )
    blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    return positions, blocks * block_size + positions % block_size


KV_SCALE_BYTES = 4  # the float32 scale after each quantized head vector of an int8 cache


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """`x [..., d]` as int8 `[..., d + 4]`: symmetric per vector, `scale = absmax / 127`,
    `q = round(x / scale)` clamped to +-127 (all zeros where the scale is 0), then the
    scale's four bytes. The C++ write (`ops_cpu.cpp`, `quantize_head`) rounds the same."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, xf / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 `rows [..., d + 4]` of an 8-bit cache back to `[..., d]` of `dtype`."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def _read_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as `dtype` values: dequantized from an int8 cache, else as they are."""
    return dequantize_kv(rows, dtype) if rows.dtype == torch.int8 else rows


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `k, v [num_tokens, num_kv_heads, head_dim]` at their slots of the caches
    (quantized, `quantize_kv`, into an int8 cache)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k_cache.dtype == torch.int8:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, quantize_kv(k))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, quantize_kv(v))
        return
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    ext=None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of `q [num_tokens, num_heads, head_dim]` over the paged caches; same shape out.

    `ext`: the compiled CPU ops (`cpu_ext.load()`), which then serve the decodes (reading
    an int8 cache in place too). `window`: a sliding window of that many keys (0: none),
    whose `WindowMetadata` `md` holds. `softcap`: the scores soft-capped (0: not; module doc).
    """
    if md.all_decode:
        return _decode_attention(q, k_cache, v_cache, md, scale, ext, window, softcap)
    out = torch.empty_like(q)
    if md.decode_seqs.numel():
        dec = q.index_select(0, md.decode_tokens)
        dec = _decode_attention(dec, k_cache, v_cache, md, scale, ext, window, softcap)
        out.index_copy_(0, md.decode_tokens, dec)
    bs = k_cache.shape[1]
    windowed = _window(md, window).prefills if window else None
    for i, (seq, start, qlen, ctx) in enumerate(md.prefills):
        first, mask = windowed[i] if windowed is not None else (0, md.prefill_masks[i])
        blocks = md.block_tables[seq, first : -(-ctx // bs)]
        keys = ctx - first * bs
        # index_select, not `k_cache[blocks]`: PyTorch's CPU advanced indexing of a large
        # cache took ~3 ms a call (~500x), a third of a prefill step's time.
        k = _read_kv(k_cache.index_select(0, blocks).flatten(0, 1)[:keys], q.dtype)
        v = _read_kv(v_cache.index_select(0, blocks).flatten(0, 1)[:keys], q.dtype)
        chunk = q[start : start + qlen]
        if softcap:
            out[start : start + qlen] = _capped_attention(chunk, k, v, mask, scale, softcap)
        else:
            out[start : start + qlen] = _prefill_attention(chunk, k, v, mask, scale)
    return out


def _window(md: AttentionMetadata, window: int) -> WindowMetadata:
    wmd = md.windows.get(window)
    if wmd is None:
        raise ValueError(f"attention metadata without window {window}: build_metadata(windows=)")
    return wmd


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    ext,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence. The compiled CPU kernel reads the blocks in place."""
    if ext is None:
        return decode_attention_torch(q, k_cache, v_cache, md, scale, window, softcap)
    if window:
        w = _window(md, window)
        return ext.paged_decode(
            q, k_cache, v_cache, w.decode_tables, w.decode_lens, scale, False, w.decode_skip,
            softcap,
        )  # fmt: skip
    tables, lens = md.block_tables, md.context_lens
    if not md.all_decode:
        tables, lens = tables.index_select(0, md.decode_seqs), lens.index_select(0, md.decode_seqs)
    return ext.paged_decode(q, k_cache, v_cache, tables, lens, scale, False, None, softcap)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence: one gather, two batched matmuls, padded keys masked
    (and, with a `window`, the keys before it); `softcap`: the scores capped first."""
    n, num_heads, head_dim = q.shape
    bs, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if window:
        w = _window(md, window)
        tables, pad = w.decode_tables, w.decode_pad
    else:
        tables, pad = md.block_tables[:, : md.decode_max_blocks], md.decode_pad
        if not md.all_decode:
            tables = tables.index_select(0, md.decode_seqs)
    length = tables.shape[1] * bs
    # [n, L, kvh, d] -> [n, kvh, L, d]
    flat = tables.reshape(-1)  # index_select: see paged_attention
    k = _read_kv(k_cache.index_select(0, flat), q.dtype)
    v = _read_kv(v_cache.index_select(0, flat), q.dtype)
    k = k.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    qg = q.view(n, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * scale  # [n, kvh, g, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(n, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk `q [n, H, d]` that ends a context `k, v [ctx, kvh, d]`.

    `mask [n, ctx]` (True: attend) is None when the chunk is the whole context: plain causal.
    """
    # 4-d [1, heads, n, d]: with a batch dimension PyTorch runs its CPU flash kernel;
    # 3-d inputs fall back to the slower math path.
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )[0].transpose(0, 1)


CAPPED_TILE = 1 << 24  # the most scores (float32) that `_capped_attention` holds at once


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """`_prefill_attention` with soft-capped scores, computed explicitly in float32 (SDPA
    has no cap) as transformers' eager attention: scores, scale, cap, the mask, softmax,
    values; in tiles of queries that hold at most `CAPPED_TILE` scores."""
    n, heads, d = q.shape
    ctx, kv_heads = k.shape[:2]
    group = heads // kv_heads
    kt = k.float().permute(1, 2, 0).unsqueeze(1)  # [kvh, 1, d, ctx]
    vt = v.float().transpose(0, 1).unsqueeze(1)  # [kvh, 1, ctx, d]
    if mask is None:  # the chunk is the whole context: plain causal
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril_()
    out = torch.empty_like(q)
    rows = max(1, CAPPED_TILE // (heads * ctx))
    for r in range(0, n, rows):
        qt = q[r : r + rows].float().view(-1, kv_heads, group, d).permute(1, 2, 0, 3)
        scores = torch.matmul(qt, kt) * scale  # [kvh, g, rows, ctx]
        scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(~mask[r : r + rows], float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1), vt)  # [kvh, g, rows, d]
        out[r : r + rows] = o.permute(2, 0, 1, 3).reshape(-1, heads, d).to(q.dtype)
    return out
