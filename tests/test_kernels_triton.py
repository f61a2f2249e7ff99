"""The Triton kernels against their PyTorch references, on the CPU under Triton's interpreter.

Triton decides at import whether it interprets (`TRITON_INTERPRET=1`), and it
cannot be imported twice in one process. So:

- on a machine without CUDA where nothing has imported Triton yet, this module
  imports it with `TRITON_INTERPRET=1` set only for the import, then pins the
  mode with `triton.knobs.runtime.interpret` and restores the environment: the
  variable never leaks into later tests or their subprocesses, and nothing else
  on such a machine runs Triton;
- elsewhere (CUDA present, so later tests may run compiled Triton; or Triton
  already imported compiled) the same tests run in a child process with
  `TRITON_INTERPRET=1` (`test_interpreted_in_child_process`).

Every run gets fresh random inputs and outputs poisoned with NaN; unused cache
slots hold NaN too, so a kernel that reads past a sequence's context, or leaves
an output unwritten, fails (NaN never passes). float32 and float16 only: the
interpreter's bfloat16 is unreliable.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from subway.kernels import attention as ref_attn
from subway.kernels import ops as ref_ops

if importlib.util.find_spec("triton") is None:  # importorskip would import it, compiled
    pytest.skip("triton is not installed", allow_module_level=True)

_TRITON_MODULES = ("subway.kernels.triton_attention", "subway.kernels.triton_ops")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]


def _interpreted_triton() -> bool:
    """Import Triton in interpreter mode if this process may; True if it runs interpreted."""
    if "triton" not in sys.modules:
        if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
            return False
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton

            try:  # Triton imports this lazily at the first launch, and it reads the variable
                import triton.experimental.gluon  # noqa: F401
            except ImportError:  # older Triton: no gluon
                pass
            triton.knobs.runtime.interpret = True  # pinned: no longer read from the environment
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    import triton

    return bool(triton.knobs.runtime.interpret)


INTERPRETED = _interpreted_triton()


@pytest.fixture(scope="module")
def kt():
    """The Triton kernel modules, interpreted: (attention, ops)."""
    if not INTERPRETED:
        pytest.skip(
            "Triton is compiled in this process: test_interpreted_in_child_process runs these"
        )
    from triton.runtime.interpreter import InterpretedFunction

    mods = [importlib.import_module(name) for name in _TRITON_MODULES]
    attn, ops = (
        m if isinstance(getattr(m, k), InterpretedFunction) else importlib.reload(m)
        for m, k in zip(mods, ("_write_kv_kernel", "_silu_and_mul_kernel"), strict=True)
    )
    return attn, ops


def _interpreted_in_child_process():
    """Where this process cannot interpret Triton, run this module in one that does."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert " passed" in summary and skipped is None, summary


if not INTERPRETED:  # only then: where this process interprets, the tests below run here
    test_interpreted_in_child_process = _interpreted_in_child_process


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "non-finite values in the output"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# ------------------------------------------------------------------ attention


def _paged_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Caches holding every sequence's context (unused slots NaN), metadata, and q."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in seqs) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = rng.permutation(num_blocks)
    max_blocks = max(-(-ctx // block_size) for _, ctx in seqs)
    tables = np.zeros((len(seqs), max_blocks + 1), dtype=np.int32)
    used = 0
    for i, (_, ctx) in enumerate(seqs):
        nb = -(-ctx // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    qlens = np.array([q for q, _ in seqs], dtype=np.int64)
    ctxs = np.array([c for _, c in seqs], dtype=np.int64)
    _, slots = ref_attn.positions_and_slots(ctxs, ctxs, tables, block_size)
    total = int(ctxs.sum())
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    ref_attn.write_kv(k, v, k_cache, v_cache, torch.from_numpy(slots))
    _, step_slots = ref_attn.positions_and_slots(qlens, ctxs, tables, block_size)
    md = ref_attn.build_metadata(qlens, ctxs, tables, step_slots, block_size, "cpu")
    q = torch.randn(int(qlens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, md


def _reference_attention(q, k_cache, v_cache, md, scale):
    """The reference, in float32 on NaN-free copies of the caches (it reads padded slots)."""
    kc = torch.nan_to_num(k_cache.float(), nan=0.0)
    vc = torch.nan_to_num(v_cache.float(), nan=0.0)
    return ref_attn.paged_attention(q.float(), kc, vc, md, scale)


# (query_len, context_len): decodes, fresh prefills, chunks after a cached prefix.
MIXED = [(1, 7), (5, 5), (3, 10), (1, 1), (1, 13), (6, 14), (1, 4), (9, 9), (2, 3)]
DECODES = [(1, 5), (1, 37), (1, 2), (1, 70), (1, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seqs,num_heads,num_kv_heads,head_dim,block_size",
    [
        (MIXED, 6, 2, 16, 4),  # GQA group 3: rows of a tile span query tokens and heads
        (MIXED, 4, 4, 32, 16),  # MHA
        (DECODES, 8, 2, 16, 4),  # all decodes
        ([(7, 7), (40, 45), (2, 33)], 4, 1, 24, 3),  # prefills; odd head_dim and block size
        ([(1, 3), (70, 70), (1, 50)], 2, 2, 16, 16),  # a chunk longer than one query block
    ],
)
def test_paged_attention(kt, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    attn, _ = kt
    for seed in (0, 1):
        q, kc, vc, md = _paged_case(
            seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
        )
        scale = head_dim**-0.5
        out = torch.full_like(q, float("nan"))
        attn.paged_attention(q, kc, vc, md, scale, out=out)
        _assert_close(out, _reference_attention(q, kc, vc, md, scale), dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_split_decode(kt, num_splits, dtype):
    """Flash decoding: the keys of each decode split over programs, then merged."""
    attn, _ = kt
    q, kc, vc, md = _paged_case(DECODES, 8, 2, 16, 4, dtype, seed=num_splits)
    out = torch.full_like(q, float("nan"))
    attn.paged_attention(q, kc, vc, md, 0.25, num_splits=num_splits, out=out)
    _assert_close(out, _reference_attention(q, kc, vc, md, 0.25), dtype)


def test_paged_attention_strided_q(kt):
    """q as the model has it: a view into the fused qkv projection's output."""
    attn, _ = kt
    q, kc, vc, md = _paged_case(MIXED, 4, 2, 16, 4, torch.float32, seed=3)
    qkv = torch.randn(q.shape[0], 8 * 16)
    qkv[:, : 4 * 16] = q.view(q.shape[0], -1)
    q_view = qkv[:, : 4 * 16].view(q.shape[0], 4, 16)
    assert not q_view.is_contiguous()
    out = attn.paged_attention(q_view, kc, vc, md, 0.25)
    _assert_close(out, _reference_attention(q, kc, vc, md, 0.25), torch.float32)


def test_choose_splits():
    from subway.kernels.triton_attention import choose_splits

    cpu = torch.device("cpu")  # counts as 8 SMs
    assert choose_splits(64, 8, 8192, cpu) == 1  # enough programs already
    assert choose_splits(1, 2, 256, cpu) == 1  # short contexts
    assert 1 < choose_splits(1, 2, 4096, cpu) <= 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(kt, dtype):
    attn, _ = kt
    gen = torch.Generator().manual_seed(5)
    shape = (6, 4, 3, 16)  # blocks, block size, kv heads, head dim
    for _ in range(2):
        slots = torch.randperm(24, generator=gen)[:7]
        slots[3] = -1  # padding: skipped
        kv = torch.randn(2, 7, 8, 16, generator=gen).to(dtype)[:, :, :3]  # strided, as in qkv
        k, v = kv[0], kv[1]
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        attn.write_kv(k, v, k_cache, v_cache, slots)
        flat_k, flat_v = k_cache.view(-1, 3, 16), v_cache.view(-1, 3, 16)
        keep = slots >= 0
        torch.testing.assert_close(flat_k[slots[keep]], k[keep], atol=0, rtol=0)
        torch.testing.assert_close(flat_v[slots[keep]], v[keep], atol=0, rtol=0)
        untouched = torch.ones(24, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


# ------------------------------------------------------------------ 8-bit caches


def _int8_caches(k_cache, v_cache):
    """The float caches of a `_paged_case` as 8-bit caches (quantize_kv per slot and head),
    their unused slots (NaN) filled with 0x7F bytes, whose scale is 3.4e38: a kernel that
    reads one fails. Also the float caches the reference reads: the quantized ones
    dequantized, zeros where unused."""
    out = []
    for cache in (k_cache, v_cache):
        unused = cache.isnan().any(-1)
        q8 = ref_attn.quantize_kv(torch.nan_to_num(cache.float(), nan=0.0))
        ref = ref_attn.dequantize_kv(q8, torch.float32)
        q8[unused] = 0x7F
        out += [q8, ref]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seqs,num_heads,num_kv_heads,head_dim,block_size",
    [(MIXED, 6, 2, 16, 4), (DECODES, 8, 2, 16, 4), ([(7, 7), (40, 45), (2, 33)], 4, 1, 24, 3)],
)
def test_paged_attention_over_an_8_bit_cache(
    kt, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    """The int8 caches read in place, against the float reference over their dequantized
    values; split decodes too."""
    attn, _ = kt
    q, kc, vc, md = _paged_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, 2)
    k8, k_ref, v8, v_ref = _int8_caches(kc, vc)
    scale = head_dim**-0.5
    want = ref_attn.paged_attention(q.float(), k_ref, v_ref, md, scale)
    for splits in (None, 3) if md.all_decode else (None,):
        out = torch.full_like(q, float("nan"))
        attn.paged_attention(q, k8, v8, md, scale, num_splits=splits, out=out)
        _assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_an_8_bit_cache_as_quantize_kv_does(kt, dtype):
    """The same bytes as the reference's write (quantize_kv): vectors, scales, an all-zero
    vector (scale 0), a padding slot skipped, every other byte untouched."""
    attn, _ = kt
    gen = torch.Generator().manual_seed(6)
    shape = (6, 4, 3, 16 + ref_attn.KV_SCALE_BYTES)
    slots = torch.randperm(24, generator=gen)[:7]
    slots[3] = -1
    kv = (torch.randn(2, 7, 8, 16, generator=gen) * 3).to(dtype)[:, :, :3]  # strided
    kv[0, 5, 1] = 0.0  # a vector of zeros
    k, v = kv[0], kv[1]
    got = [torch.full(shape, 0x55, dtype=torch.int8) for _ in range(2)]
    want = [c.clone() for c in got]
    attn.write_kv(k, v, got[0], got[1], slots)
    keep = slots >= 0  # the reference takes no padding
    ref_attn.write_kv(k[keep], v[keep], want[0], want[1], slots[keep])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0].view(-1, 3, 20)[slots[5], 1] == 0).all()  # zeros, and a scale of 0.0


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    """Triton's real compiler (ptxas ships with Triton: no GPU needed) takes every kernel.

    In a child process: this one interprets Triton. Catches what the interpreter
    forgives (loop-carried types, constexpr rules, the num_seqs == 1 specialisation).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from subway.tools.gpu_check import Report, aot_compile; "
        f"r = Report({str(tmp_path / 'compile.log')!r}); aot_compile(r, (9, 0), full=False); "
        "assert not r.failed"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[PASS] compile for sm_90" in proc.stdout


# ------------------------------------------------------------------ elementwise and norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 100), (1, 16)])
def test_rms_norm(kt, dtype, shape):
    _, ops = kt
    gen = torch.Generator().manual_seed(sum(shape))
    for _ in range(2):
        x = torch.randn(shape, generator=gen).to(dtype)
        res = torch.randn(shape, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
        out = torch.full_like(x, float("nan"))
        ops.rms_norm(x, w, 1e-6, out=out)
        _assert_close(out, ref_ops.rms_norm(x, w, 1e-6), dtype)
        ref_out, ref_res = ref_ops.rms_norm(x, w, 1e-6, residual=res.clone())
        out = torch.full_like(x, float("nan"))
        got, new_res = ops.rms_norm(x, w, 1e-6, residual=res, out=out)
        assert got is out and new_res is res  # the residual stream is updated in place
        _assert_close(res, ref_res, dtype)
        _assert_close(out, ref_out, dtype)


def test_rms_norm_per_head(kt):
    """Qwen3's q/k norm: `[tokens, heads, head_dim]` views of the qkv output."""
    _, ops = kt
    qkv = torch.randn(7, 6 * 32)
    q = qkv[:, : 4 * 32].view(7, 4, 32)
    w = torch.randn(32)
    _assert_close(ops.rms_norm(q, w, 1e-6), ref_ops.rms_norm(q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q,num_k", [(16, 4, 2), (32, 6, 1), (64, 3, 3)])
def test_rope(kt, dtype, head_dim, num_q, num_k):
    _, ops = kt
    gen = torch.Generator().manual_seed(head_dim)
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }  # fmt: skip
    cache = ref_ops.rope_cos_sin_cache(
        ref_ops.rope_inv_freq(head_dim, 10000.0, scaling), 200, dtype, "cpu"
    )
    for _ in range(2):
        t = 9
        pos = torch.randint(0, 200, (t,), generator=gen)
        qkv = torch.randn(t, (num_q + 2 * num_k) * head_dim, generator=gen).to(dtype)
        q = qkv[:, : num_q * head_dim].view(t, num_q, head_dim)
        k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(t, num_k, head_dim)
        v_before = qkv[:, (num_q + num_k) * head_dim :].clone()
        ref_q, ref_k = ref_ops.apply_rope(q.float(), k.float(), pos, cache.float())
        got_q, got_k = ops.apply_rope(q, k, pos, cache)
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
        _assert_close(q, ref_q, dtype)
        _assert_close(k, ref_k, dtype)
        assert torch.equal(qkv[:, (num_q + num_k) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64), (3, 2 * 700), (1, 32)])
def test_silu_and_mul(kt, dtype, shape):
    _, ops = kt
    gen = torch.Generator().manual_seed(shape[1])
    for _ in range(2):
        x = (2 * torch.randn(shape, generator=gen)).to(dtype)
        out = torch.full((shape[0], shape[1] // 2), float("nan"), dtype=dtype)
        ops.silu_and_mul(x, out=out)
        _assert_close(out, ref_ops.silu_and_mul(x), dtype)


# ------------------------------------------------------------------ dispatch


def test_dispatch_picks_by_device():
    from subway.kernels import dispatch

    assert dispatch.backend("auto", "cpu") == "torch"
    assert dispatch.backend("auto", "cuda") == (
        "triton" if dispatch.triton_available() else "torch"
    )
    assert dispatch.backend("triton", "cpu") == "triton"
    assert dispatch.backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="kernels='bogus'"):
        dispatch.backend("bogus", "cpu")
    with pytest.raises(ValueError, match="kernels='bogus'"):
        dispatch.choose_kernels("bogus", True, "cpu")


def test_dispatch_cpu_default_is_the_reference():
    """By default, a CPU model never reaches Triton (nor imports it)."""
    from subway.kernels import dispatch

    k = dispatch.choose_kernels("auto", True, "cpu")
    assert k.name == "torch"
    x = torch.randn(3, 8)
    w = torch.randn(4)
    assert torch.equal(k.silu_and_mul(x), ref_ops.silu_and_mul(x))
    assert torch.equal(k.rms_norm(x[:, :4], w, 1e-6), ref_ops.rms_norm(x[:, :4], w, 1e-6))


def test_dispatch_forced_triton(kt):
    from subway.kernels import dispatch

    k = dispatch.choose_kernels("triton", True, "cpu")
    assert k.name == "triton"
    x = torch.randn(3, 32)
    out = k.silu_and_mul(x)
    _assert_close(out, ref_ops.silu_and_mul(x), torch.float32)


def test_capture_sizes_and_when_graphs_apply():
    from types import SimpleNamespace

    from subway.ipc.config import EngineConfig
    from subway.worker.cuda_graph import capture_sizes, maybe_decode_graphs

    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    cpu = SimpleNamespace(
        config=EngineConfig.build(enforce_eager=False, max_num_seqs=8),
        device=torch.device("cpu"),
        tp=SimpleNamespace(world_size=1),
    )
    assert maybe_decode_graphs(cpu) is None  # CUDA only; the rest is checked on a GPU


# ------------------------------------------------------------------ the engine, forced Triton


def _engine_greedy(path: str, prompts, max_new: int, emulate_graphs: bool, kernels: str, **kw):
    from subway.ipc.config import EngineConfig
    from subway.ipc.messages import SamplingParams
    from subway.llm import LLM

    config = EngineConfig.build(
        path=path,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=8,  # chunked prefill beside decodes
        max_num_seqs=4,
        kernels=kernels,
        **kw,
    )
    engine = LLM(config)
    if emulate_graphs:
        from subway.worker.cuda_graph import DecodeGraphs

        # The CUDA-graph path (static buffers, padding to captured sizes) run eagerly.
        engine.runner.graphs = DecodeGraphs(engine.runner, sizes=[1, 2, 4], capture=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    outs = engine.generate(prompts, params)
    return outs, engine


PROMPTS = [
    [5, 17, 300, 41, 9, 77, 123, 8, 66, 12, 901, 4, 4, 70, 18, 23, 61, 30, 2000],
    [44, 3],
    [250, 7, 7, 19, 88],
    [1500],
    [9, 8, 7, 6, 5, 4, 3, 31, 32, 33],
]


@pytest.mark.parametrize(
    "arch,emulate_graphs",
    [
        ("llama", False),
        *(pytest.param(a, True, marks=pytest.mark.slow) for a in ("llama", "qwen3")),
    ],
)
def test_engine_greedy_with_triton(kt, tiny_models, monkeypatch, arch, emulate_graphs):
    """The real scheduler and runner, every kernel forced to Triton (interpreted): greedy = HF.

    Five prompts under an 8-token budget and 4 sequences at most: chunked
    prefills beside decodes, then decode batches of 1 to 4 (padded to 4 with
    the graph path).
    """
    from reference import compare, hf_greedy

    attn, ops = kt
    calls = {"attention": 0, "rope": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(attn, "paged_attention", counted(attn.paged_attention, "attention"))
    monkeypatch.setattr(ops, "apply_rope", counted(ops.apply_rope, "rope"))
    torch.set_num_threads(1)
    path = tiny_models[arch]
    max_new = 10
    t0 = time.perf_counter()
    outs, engine = _engine_greedy(path, PROMPTS, max_new, emulate_graphs, kernels="triton")
    elapsed = time.perf_counter() - t0
    assert calls["attention"] > 0 and calls["rope"] == calls["attention"]
    if emulate_graphs:
        assert engine.runner.graphs.replays > 0
    near_ties = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_greedy(path, prompt, max_new)
        near_ties += compare(out.token_ids, ref, out.top_ids)
    print(
        f"{arch}, triton (interpreted): {engine.scheduler.stats.num_steps_total} steps in {elapsed:.1f}s"
    )
    assert near_ties == 0


def test_engine_over_an_8_bit_cache_with_triton_as_with_the_cpu_kernels(kt, tiny_models):
    """`--kv-cache-dtype int8` through the Triton kernels (interpreted; graph path emulated)
    against the C++ CPU kernels: both write the same bytes (above) and attend over them in
    float32, so greedy tokens agree but for a near-tie (each side's token in the other's
    top 5)."""
    torch.set_num_threads(1)
    path = tiny_models["llama"]
    tri, engine = _engine_greedy(path, PROMPTS, 10, True, "triton", kv_cache_dtype="int8")
    assert engine.runner.kv_caches[0][0].dtype == torch.int8 and engine.runner.graphs.replays
    cpu, _ = _engine_greedy(path, PROMPTS, 10, False, "auto", kv_cache_dtype="int8")
    near_ties = 0
    for a, b in zip(tri, cpu, strict=True):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                assert x in b.top_ids[i] and y in a.top_ids[i], (i, a.token_ids, b.token_ids)
                near_ties += 1
                break
    assert near_ties <= 1
