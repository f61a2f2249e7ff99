"""The compiled CPU decode-attention kernel: its AVX-512 path and its generic path, against
the PyTorch reference, over dtypes, head sizes, GQA groups and contexts that end on and off
block boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from subway.kernels import cpu_ext
from subway.kernels.attention import build_metadata, decode_attention_torch, positions_and_slots

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None, reason="no C++ compiler: the reference is used")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128), (6, 2, 24)],  # 24: no fast path
)
def test_decode_kernel_matches_reference(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    block_size, num_blocks = 16, 160
    ctx = np.array([1, 15, 16, 17, 33, 64, 100, 250], dtype=np.int64)
    max_blocks = int(-(-ctx.max() // block_size))
    tables = rng.permutation(num_blocks)[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks)
    tables = tables.astype(np.int32)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(ctx), heads, head_dim, generator=gen).to(dtype)
    qlens = np.ones(len(ctx), dtype=np.int64)
    _, slots = positions_and_slots(qlens, ctx, tables, block_size)
    md = build_metadata(qlens, ctx, tables, slots, block_size, "cpu")
    scale = head_dim**-0.5
    ref = decode_attention_torch(q.float(), kc.float(), vc.float(), md, scale)
    lens = torch.from_numpy(ctx.astype(np.int32))
    table_t = torch.from_numpy(tables)
    for generic in (False, True):
        out = ext.paged_decode(q, kc, vc, table_t, lens, scale, generic)
        assert out.dtype == dtype and out.shape == q.shape
        tol = TOL[dtype]
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_fast_path_compiled_here():
    """This machine has AVX-512 (the development VM and CI): the fast path must be built."""
    with open("/proc/cpuinfo") as f:
        has = " avx512f " in f.read().replace("\n", " ")
    assert ext.has_avx512() == has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_matches_f_linear(dtype, rows):
    from subway.worker.layers import linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 48, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    packed = pack_weight(w, 64)
    assert packed is not None  # oneDNN is part of every x86 CPU build of torch
    for bias in (None, b):
        got = linear(x, w, bias, packed)
        want = torch.nn.functional.linear(x, w, bias)
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)  # the same oneDNN kernel, without the per-call reorder
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_runner_packs_its_linear_layers(tiny_models):
    from subway.ipc.config import EngineConfig
    from subway.worker.layers import PackedLinear
    from subway.worker.runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=tiny_models["llama"], num_kv_blocks=8))
    layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed is not None for m in layers)
    assert runner.model.lm_head_packed is not None
