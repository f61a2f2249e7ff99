"""The compiled CPU decode-attention kernel: its AVX-512 (or AVX2) path and its generic path, against
the PyTorch reference, over dtypes, head sizes, GQA groups and contexts that end on and off
block boundaries."""

from __future__ import annotations

import contextlib

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
    [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128), (4, 1, 256), (6, 2, 24)],  # 24: no fast path
)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "contexts",
    # work per sequence; per (sequence, KV head); and one sequence, where fewer KV heads than
    # two a thread share each sequence's keys, rows and chunks among the threads (AVX2)
    [[1, 15, 16, 17, 33, 64, 100, 250], [250, 17], [300]],
)
def test_decode_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size, contexts):
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    num_blocks = 160
    ctx = np.array(contexts, dtype=np.int64)
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
        flags = f.read().replace("\n", " ")
    has = " avx512f " in flags
    assert ext.has_avx512() == has
    # Without AVX-512, the AVX2 path (AVX2, FMA and F16C: every x86 CPU since 2013).
    assert ext.has_avx2() == (not has and all(f" {x} " in flags for x in ("avx2", "fma", "f16c")))


AVX2_CHECK = """
import os, sys
import numpy as np, torch
from torch.utils import cpp_extension
from subway.kernels import cpu_ext
from subway.kernels.attention import build_metadata, decode_attention_torch, positions_and_slots

csrc = os.path.join(os.path.dirname(cpu_ext.__file__), "csrc")
ext = cpp_extension.load(
    name="subway_cpu_kernels_avx2", sources=[os.path.join(csrc, f) for f in cpu_ext.SOURCES],
    extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"],
    extra_ldflags=["-fopenmp"], build_directory=sys.argv[1])
assert ext.has_avx2() and not ext.has_avx512()
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
for dtype in TOL:
    for heads, kvh, hd in [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128), (4, 1, 256)]:
        for bs in (16, 32):
            for contexts in ([1, 15, 16, 17, 33, 64, 100, 250], [250, 17], [300]):
                gen = torch.Generator().manual_seed(0)
                ctx = np.array(contexts)
                mb = int(-(-ctx.max() // bs))
                rng = np.random.default_rng(1)
                tables = rng.permutation(160)[: len(ctx) * mb].reshape(len(ctx), mb)
                tables = tables.astype(np.int32)
                kc = torch.randn(160, bs, kvh, hd, generator=gen).to(dtype)
                vc = torch.randn(160, bs, kvh, hd, generator=gen).to(dtype)
                q = torch.randn(len(ctx), heads, hd, generator=gen).to(dtype)
                ones = np.ones(len(ctx), dtype=np.int64)
                _, slots = positions_and_slots(ones, ctx, tables, bs)
                md = build_metadata(ones, ctx, tables, slots, bs, "cpu")
                ref = decode_attention_torch(q.float(), kc.float(), vc.float(), md, hd**-0.5)
                out = ext.paged_decode(q, kc, vc, torch.from_numpy(tables),
                                       torch.from_numpy(ctx.astype(np.int32)), hd**-0.5, False)
                torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
assert ext.small_linear_rows() == 64  # no AMX without AVX-512; the blocked kernel to 64 rows
for rows in (1, 2, 3, 4, 8, 16, 25, 64):
    for n, k in [(960, 576), (130, 64), (7, 32)]:
        gen = torch.Generator().manual_seed(rows)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ref = (x.double() @ w.double().T + b.double()).float()
        got = ext.small_linear(x, ext.small_linear_pack(w), b)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=1e-2)
try:
    ext.small_linear(torch.zeros(65, 64, dtype=torch.bfloat16), torch.zeros(16, 64).bfloat16())
    raise SystemExit("65 rows should be refused")
except RuntimeError:
    pass
print("avx2 ok")
"""


@pytest.mark.slow
def test_avx2_path_matches_reference(tmp_path):
    """The AVX2 path (machines without AVX-512) is compiled out here when the machine has
    AVX-512: build the kernels again without it, in a process of their own (two builds
    cannot share one), and check them as above."""
    import subprocess
    import sys

    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if " avx2 " not in flags.replace("\n", " "):
        pytest.skip("this CPU has no AVX2")
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK, str(tmp_path)], capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0 and "avx2 ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_matches_f_linear(dtype, rows):
    from subway.worker.layers import linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 48, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    packed = pack_weight(w, 64)
    with open("/proc/cpuinfo") as f:
        native_bf16 = " avx512_bf16 " in f.read().replace("\n", " ")
    if dtype == torch.float32 or native_bf16:
        # oneDNN is part of every x86 CPU build of torch; its bfloat16 kernels need
        # AVX512-BF16 (on an AVX2-only CPU the reorder is refused and None means F.linear).
        assert packed is not None
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

    runner = ModelRunner(EngineConfig.build(path=tiny_models["llama"], num_kv_blocks=8))
    layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed is not None for m in layers)
    assert runner.model.lm_head_packed is not None


def test_cpu_ext_is_a_config_field(tiny_models):
    """`ModelConfig.cpu_ext` (`--no-cpu-ext`) decides once, when the model is built."""
    from subway.ipc.config import EngineConfig
    from subway.kernels import ops
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.runner import ModelRunner

    assert choose_kernels("auto", True, "cpu").rms_norm is not ops.rms_norm
    assert choose_kernels("auto", False, "cpu").rms_norm is ops.rms_norm
    config = EngineConfig.build(path=tiny_models["llama"], num_kv_blocks=8, cpu_ext=False)
    kernels = ModelRunner(config).model.kernels
    assert kernels.name == "torch" and kernels.rms_norm is ops.rms_norm


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 units in the last place (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_rms_norm_matches_reference(dtype, rows):
    from subway.kernels.ops import rms_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    res = torch.randn(rows, 96, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    (plain,) = ext.rms_norm(x, None, w, 1e-5)
    out, new_res = ext.rms_norm(x, res, w, 1e-5)
    ref_plain = rms_norm(x, w, 1e-5)
    ref_out, ref_res = rms_norm(x, w, 1e-5, res)
    assert torch.equal(new_res, ref_res)  # the residual add rounds exactly as torch does
    if dtype == torch.bfloat16:  # only the float32 sum's order differs: at most one ulp
        assert _ulps_bf16(plain, ref_plain) <= 1 and _ulps_bf16(out, ref_out) <= 1
        assert (plain != ref_plain).float().mean() < 0.01
    else:
        torch.testing.assert_close(plain, ref_plain, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_reference(dtype):
    """q, k, v as the model passes them: strided views of one qkv projection."""
    from subway.kernels.attention import write_kv
    from subway.kernels.ops import apply_rope, rope_cos_sin_cache, rope_inv_freq

    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d, bs, blocks = 13, 6, 2, 32, 4, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)
    positions = torch.randint(0, 500, (n,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    cache = rope_cos_sin_cache(rope_inv_freq(d, 10000.0), 512, dtype, "cpu")
    kc, vc = torch.zeros(blocks, bs, kv_heads, d, dtype=dtype), None
    kc2, vc = kc.clone(), torch.zeros_like(kc)
    vc2 = vc.clone()
    got_q = ext.rope_write_kv(q, k, v, positions, cache, kc, vc, slots)
    want_q, want_k = apply_rope(q, k, positions, cache)
    write_kv(want_k, v, kc2, vc2, slots)
    assert torch.equal(got_q, want_q)  # the same roundings in the same order
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_a_killed_build_does_not_hang_later_loads():
    """torch's build lock file, left by a build killed midway, is stale under our flock:
    a new process loads the kernels instead of waiting for it forever."""
    import os
    import subprocess
    import sys

    from subway.kernels import cpu_ext

    stale = os.path.join(cpu_ext._build_dir(), "lock")
    open(stale, "w").close()
    code = "from subway.kernels import cpu_ext; print(cpu_ext.load() is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert not os.path.exists(stale)


def test_packed_linears_see_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps a compiled kernel per row count of a packed matmul, forever: every
    prefill size would grow the worker's memory (the soak benchmark saw +527 MB). Rows above
    EXACT_ROWS are padded to a bucket; the results are those of the plain matmul."""
    import torch
    import torch.nn.functional as F

    from subway.worker import layers

    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    packed = layers.pack_weight(weight, 8)
    assert packed is not None
    seen: set[int] = set()
    real = layers.packed_matmul

    def recording(x, p, b):
        seen.add(x.shape[0])
        return real(x, p, b)

    monkeypatch.setattr(layers, "packed_matmul", recording)
    for rows in range(1, 513):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(
            layers.linear(x, weight, bias, packed), F.linear(x, weight, bias)
        )
    assert len(seen) <= layers.EXACT_ROWS + 512 // layers.ROW_BUCKET


@pytest.mark.parametrize("vocab", [49152, 1000, 77])  # 77, 1000: a last word only partly used
def test_token_bitmask_kernel_matches_xgrammar(vocab):
    """Our mask kernel against xgrammar's own, on random words, zero words (none allowed)
    and full words (all allowed), on a subset of the rows; refuses rows out of range."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    rows, words = 9, -(-vocab // 32)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    kind = torch.randint(0, 3, (rows, words), generator=gen)
    bits = torch.where(kind == 0, torch.zeros_like(bits), bits)
    bits = torch.where(kind == 1, torch.full_like(bits, -1), bits)
    logits = torch.randn(rows, vocab, generator=gen)
    which = [0, 3, 4, 8]
    ours, theirs = logits.clone(), logits.clone()
    ext.apply_token_bitmask(ours, bits, which)
    xgr.apply_token_bitmask_inplace(theirs, bits, vocab_size=vocab, indices=which)
    assert torch.equal(ours, theirs)
    untouched = [r for r in range(rows) if r not in which]
    assert torch.equal(ours[untouched], logits[untouched])
    assert torch.isinf(ours[which]).any() and not torch.isinf(ours[untouched]).any()
    with pytest.raises(RuntimeError):
        ext.apply_token_bitmask(ours, bits, [rows])


def _exact_bf16_linear(x, w, b):
    y = x.double() @ w.double().T
    return (y + b.double() if b is not None else y).to(torch.bfloat16)


def _assert_within_one_ulp_or_float32_sum(got, x, w, b):
    """Within one bfloat16 ulp of the exactly rounded product, except where the sum cancels
    to below its float32 error (K * 2^-24 * sum |x_i w_i|, plus the bias's term)."""
    exact = _exact_bf16_linear(x, w, b)
    ulps = (got.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    bound = (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0**-24
    if b is not None:
        bound = bound + b.double().abs() * 2.0**-24
    near = (got.double() - exact.double()).abs() <= bound + exact.double().abs() * 2.0**-8
    assert bool(((ulps <= 1) | near).all()), int(ulps.max())


ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 64, 65)


def _small_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The few-row linear on `w` as it reads it (`small_linear_pack`: on AVX2 its own layout)."""
    return ext.small_linear(x, ext.small_linear_pack(w), bias)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(
    ext is None or not ext.small_linear_supported(), reason="neither AVX512-BF16 nor AVX2"
)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_in", [(960, 576), (576, 1536), (7, 32), (130, 64), (100, 96)])
def test_small_linear_is_within_one_ulp_of_the_exact_product(rows, out_in):
    """The few-row bfloat16 linear (the stripe kernel up to 4 rows, AMX from 5 where the CPU
    has it): the float32 sum rounded once, so within one bfloat16 ulp of the exactly rounded
    product; with and without a bias; odd output sizes (the stripes' and AMX strips' tails).
    Past `small_linear_rows()` it refuses."""
    n, k = out_in
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    if rows > ext.small_linear_rows():
        with pytest.raises(RuntimeError):
            _small_linear(x, w)
        return
    for bias in (None, b):
        got = _small_linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        _assert_within_one_ulp_or_float32_sum(got, x, w, bias)
    with pytest.raises(RuntimeError):
        _small_linear(torch.zeros(1, 48, dtype=torch.bfloat16), torch.zeros(16, 48).bfloat16())


@pytest.mark.skipif(
    ext is None or not ext.small_linear_supported(), reason="neither AVX512-BF16 nor AVX2"
)
def test_small_linear_gives_a_row_the_same_bits_in_any_batch_it_takes():
    """Each output row's sum runs in the same order whatever the row count, over the rows the
    kernel takes (the stripe kernel's 1 to 4 on AVX512-BF16; on AVX2 the blocked kernel's 1
    to `small_linear_rows`, 64): so a sequence's bfloat16 linears give the same bits alone,
    in a small batch, or as a speculative step's verification rows. A one-row loop that
    summed in another order than the kernel's batches made 3 of 8 bfloat16 greedy outputs
    part from speculative decoding's (`bench_spec --equality`), so it was dropped."""
    # Another order of sums moves a float32 sum by a few of its ulps, which a bfloat16
    # rounding hides but for about 1 output in 10,000: so many outputs (the one-row loop's
    # build gave other bits in 9 of 65,536 such outputs in one draw, and fails this test).
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(4096, 1536, generator=gen) * 0.05).to(torch.bfloat16)
    bias = (torch.randn(4096, generator=gen) * 0.05).to(torch.bfloat16)
    limit = ext.small_linear_rows() if ext.has_avx2() else 4  # AMX from 5 rows sums otherwise
    x = torch.randn(limit, 1536, generator=gen).to(torch.bfloat16)
    wl = ext.small_linear_pack(w)
    alone = [ext.small_linear(x[i : i + 1], wl, bias) for i in range(limit)]
    with _threads(2):
        for rows in range(2, limit + 1):
            y = ext.small_linear(x[:rows].contiguous(), wl, bias)
            for i in range(rows):
                assert torch.equal(y[i : i + 1], alone[i]), (rows, i)


@pytest.mark.skipif(
    ext is None or not ext.small_linear_supported(), reason="neither AVX512-BF16 nor AVX2"
)
def test_small_linear_and_onednn_take_turns_on_every_thread():
    """AMX keeps its tile configuration per thread: the few-row linear sets its own and
    releases it, oneDNN's matmul (AMX too on such CPUs) sets its own on each call. Calls
    taking turns, on both threads, each give what they give alone."""
    from subway.worker.layers import pack_weight, packed_matmul

    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(576, 576, generator=gen) * 0.05).to(torch.bfloat16)
    pw = pack_weight(w, 64)
    rows = [r for r in (1, 5, 16, 32) if r <= ext.small_linear_rows()]
    xs = {r: torch.randn(r, 576, generator=gen).to(torch.bfloat16) for r in rows + [64, 200]}
    wl = ext.small_linear_pack(w)
    alone_small = {r: ext.small_linear(xs[r], wl) for r in rows}
    alone_dnn = {r: packed_matmul(xs[r], pw, None) for r in (64, 200)}
    with _threads(2):
        for _ in range(3):
            for r in rows:
                assert torch.equal(ext.small_linear(xs[r], wl), alone_small[r])
                for big in (64, 200):
                    assert torch.equal(packed_matmul(xs[big], pw, None), alone_dnn[big])


@pytest.mark.skipif(
    ext is None or not ext.small_linear_supported(), reason="neither AVX512-BF16 nor AVX2"
)
def test_bfloat16_layers_take_the_small_linear_for_few_rows(tiny_models):
    """A bfloat16 model's packed layers (not the lm_head) carry the one-row kernel, a float32
    model's none; one-row and many-row steps agree to a bfloat16 ulp per layer output."""
    from test_model_equality import make_runner

    from subway.worker.layers import PackedLinear

    runner = make_runner(tiny_models["llama"], dtype="bfloat16")
    layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.small is ext.small_linear for m in layers)
    layer = layers[0]
    x = torch.randn(3, layer.weight.shape[1]).to(torch.bfloat16)
    one = torch.cat([layer(x[i : i + 1])[0] for i in range(3)])  # the qkv split: its q
    many = layer(x)[0]
    assert _ulps_bf16(one, many) <= 1
    f32 = make_runner(tiny_models["llama"], dtype="float32")
    assert all(m.small is None for m in f32.model.modules() if isinstance(m, PackedLinear))


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (64, 49152), (3, 17), (5, 1), (7, 100)])
def test_argmax_rows_is_torchs_first_index_of_the_maximum(rows, vocab):
    """bfloat16 logits tie often: the first index of the largest value, as torch.argmax of
    the widened rows gives, ties and -inf included."""
    ext = cpu_ext.load()
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    x[0, vocab // 2] = x[0].max()  # a tie with an earlier maximum (or the same one)
    x[-1, : vocab // 3] = float("-inf")
    assert torch.equal(ext.argmax_rows(x), x.float().argmax(dim=-1))
    all_inf = torch.full((2, vocab), float("-inf"), dtype=torch.bfloat16)
    assert torch.equal(ext.argmax_rows(all_inf), all_inf.float().argmax(dim=-1))


def test_the_greedy_sampler_takes_the_bfloat16_argmax():
    from subway.ipc.messages import SamplingParams
    from subway.worker.sampler import Sampler, SampleRequest

    ext = cpu_ext.load()
    calls = []

    def counted(x):
        calls.append(x.shape)
        return ext.argmax_rows(x)

    logits = (torch.randn(6, 1000) * 3).to(torch.bfloat16)
    greedy = [SampleRequest(SamplingParams(temperature=0.0), 0, [1], 1)] * 6
    fast = Sampler(torch.device("cpu"), argmax_rows=counted)(logits, greedy)
    plain = Sampler(torch.device("cpu"))(logits, greedy)
    assert calls == [(6, 1000)] and torch.equal(fast.tokens, plain.tokens)
    with_lp = [SampleRequest(SamplingParams(temperature=0.0, logprobs=1), 0, [1], 1)] * 6
    out = Sampler(torch.device("cpu"), argmax_rows=counted)(logits, with_lp)
    assert len(calls) == 1 and out.logprobs is not None  # logprobs need the float32 rows


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_rounds_as_the_reference(rows):
    """bfloat16: silu rounded, then the product rounded, as F.silu(gate) * up; the exp is our
    polynomial, so equality is bit for bit except, rarely, one ulp at a rounding boundary."""
    if not ext.silu_and_mul_supported():
        pytest.skip("built without AVX512-BF16 or AVX2: the reference serves")
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1000, generator=gen) * 4).to(torch.bfloat16)  # a ragged tail
    ref = F.silu(x[:, :1000]) * x[:, 1000:]
    ours = ext.silu_and_mul(x)
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    one_ulp = ref.float().abs() * 2.0**-7  # a bfloat16 ulp is 2^-7 of the value, at most
    assert ((ours.float() - ref.float()).abs() <= one_ulp).all()
    assert (ours == ref).float().mean() >= 0.999


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (8, 2)])
def test_decode_kernel_gives_a_sequence_the_same_bits_alone_and_in_a_batch(heads, kv_heads):
    """On 2 threads a lone sequence's call (with 3 KV heads or 1, the AVX2 kernel splits its
    keys, softmax rows and value chunks among the threads) gives the bits the same sequence
    gets among others (one (sequence, KV head) item to a thread): the work is split another
    way, every sum is made the same way. Contexts across block and 8-key edges."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, bs, d = 120, 16, 64
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    others = torch.randn(4, heads, d, generator=gen).to(torch.bfloat16)
    with _threads(2):
        for length in (1, 7, 8, 9, 16, 17, 301, 777):
            q = torch.randn(1, heads, d, generator=gen).to(torch.bfloat16)
            blocks = -(-max(length, 90) // bs)  # the batch's longest context
            table = torch.randperm(num_blocks, generator=gen)[:blocks].int()[None]
            lens = torch.tensor([length], dtype=torch.int32)
            alone = ext.paged_decode(q, kc, vc, table, lens, d**-0.5, False)
            batch = ext.paged_decode(
                torch.cat([q, others]), kc, vc, table.repeat(5, 1),
                torch.tensor([length, 5, 40, 3, 90], dtype=torch.int32), d**-0.5, False,
            )  # fmt: skip
            assert torch.equal(alone[0], batch[0]), length
