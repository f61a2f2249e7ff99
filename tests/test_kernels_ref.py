"""The PyTorch reference kernels against naive dense formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from subway.kernels.attention import build_metadata, positions_and_slots, write_kv
from subway.kernels.dispatch import choose_kernels
from subway.kernels.ops import apply_rope, rms_norm, rope_cos_sin_cache, rope_inv_freq, silu_and_mul


def _naive_attention(q, k, v, first_pos, scale):
    """q [n, H, d] at positions first_pos.., k/v [ctx, kvh, d]: dense causal softmax attention."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


# (query_len, context_len) per sequence: decodes, a fresh prefill, prefills with a cached prefix.
MIXED = [(1, 7), (5, 5), (3, 10), (1, 1), (1, 13), (6, 14), (1, 4), (9, 9), (2, 3)]


@pytest.mark.parametrize("cpu_ext", [False, True])  # the decodes in PyTorch, or compiled
@pytest.mark.parametrize(
    "seqs,num_heads,num_kv_heads",
    [
        (MIXED, 6, 2),
        (MIXED, 4, 4),
        ([(1, 5), (1, 17), (1, 2), (1, 9)], 8, 2),  # all decodes: the fast path
        ([(7, 7), (4, 20)], 4, 1),  # all prefills
    ],
)
def test_paged_attention_matches_dense(seqs, num_heads, num_kv_heads, cpu_ext):
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    head_dim, block_size, num_blocks = 16, 4, 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    perm = rng.permutation(num_blocks)  # random, non-contiguous block tables
    max_blocks = max(-(-ctx // block_size) for _, ctx in seqs)
    tables = np.zeros((len(seqs), max_blocks + 2), dtype=np.int32)
    used = 0
    keys, values = [], []
    for i, (_, ctx) in enumerate(seqs):
        nb = -(-ctx // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        keys.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen))
    qlens = np.array([q for q, _ in seqs], dtype=np.int64)
    ctxs = np.array([c for _, c in seqs], dtype=np.int64)
    # The cached prefix first (as earlier steps would have written it), then this step's tokens.
    prefix_lens = ctxs - qlens
    _, prefix_slots = positions_and_slots(prefix_lens, prefix_lens, tables, block_size)
    write_kv(
        torch.cat([k[:p] for k, p in zip(keys, prefix_lens, strict=True)]),
        torch.cat([v[:p] for v, p in zip(values, prefix_lens, strict=True)]),
        k_cache,
        v_cache,
        torch.from_numpy(prefix_slots),
    )
    positions, slots = positions_and_slots(qlens, ctxs, tables, block_size)
    expected_pos = np.concatenate([np.arange(c - q, c) for q, c in seqs])
    np.testing.assert_array_equal(positions, expected_pos)
    md = build_metadata(qlens, ctxs, tables, slots, block_size, "cpu")
    write_kv(
        torch.cat([k[c - q :] for k, (q, c) in zip(keys, seqs, strict=True)]),
        torch.cat([v[c - q :] for v, (q, c) in zip(values, seqs, strict=True)]),
        k_cache,
        v_cache,
        md.slot_mapping,
    )
    q = torch.randn(int(qlens.sum()), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = choose_kernels("torch", cpu_ext, "cpu").paged_attention(q, k_cache, v_cache, md, scale)
    start = 0
    for i, (ql, ctx) in enumerate(seqs):
        ref = _naive_attention(q[start : start + ql], keys[i], values[i], ctx - ql, scale)
        torch.testing.assert_close(out[start : start + ql].double(), ref, atol=1e-5, rtol=1e-5)
        start += ql


def test_write_kv_slots():
    k_cache = torch.zeros(8, 4, 2, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, 30, 0]))
    torch.testing.assert_close(k_cache[1, 1], k[0])
    torch.testing.assert_close(v_cache[7, 2], v[1])
    torch.testing.assert_close(k_cache[0, 0], k[2])


def test_rms_norm():
    x = torch.randn(5, 32)
    res = torch.randn(5, 32)
    w = torch.randn(32)
    eps = 1e-6
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(rms_norm(x, w, eps), ref)
    out, new_res = rms_norm(x, w, eps, residual=res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, w * s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope(scaling):
    d, theta = 16, 10000.0
    inv = rope_inv_freq(d, theta, scaling)
    if scaling is None:
        torch.testing.assert_close(
            inv, torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)])
        )
    cache = rope_cos_sin_cache(inv, 100, torch.float32, "cpu")
    pos = torch.tensor([0, 3, 99, 42])
    q = torch.randn(4, 3, d)
    k = torch.randn(4, 2, d)
    qr, kr = apply_rope(q, k, pos, cache)
    for x, xr in ((q, qr), (k, kr)):
        ref = torch.empty_like(x)
        for t, p in enumerate(pos.tolist()):
            for i in range(d // 2):
                a = p * float(inv[i])
                c, s = math.cos(a), math.sin(a)
                x1, x2 = x[t, :, i], x[t, :, i + d // 2]
                ref[t, :, i] = x1 * c - x2 * s
                ref[t, :, i + d // 2] = x2 * c + x1 * s
        torch.testing.assert_close(xr, ref, atol=1e-4, rtol=1e-4)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul(x), g / (1 + torch.exp(-g)) * u)
