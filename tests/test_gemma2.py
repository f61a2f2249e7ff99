"""Gemma 2 (`Gemma2ForCausalLM`): soft-capping, cap * tanh(x / cap), of every attention's
scores (`attn_logit_softcapping`) and of the final logits (`final_logit_softcapping`).

Kernel level: the decode kernels' vector tanh against float64; the compiled decode kernel
(its fast path and its generic one, float32, bfloat16, an int8 cache, with and without a
sliding window's `skip`; the AVX2 build's, few-row variant included, in the slow tier) and
the PyTorch reference (decodes, and prefill chunks computed explicitly, SDPA having no
cap) against attention computed densely in float64. Model level: a tiny random Gemma 2
(conftest's `build_tiny_model("gemma2")`: sliding and global layers in turn, a window
shorter than the prompts, caps small enough to matter) greedy as transformers, token for
token: many requests in flight, chunked prefill past the window, preemption, prefix-cache
hits and n-gram drafts through `LLM`; the logprobs are those of the capped logits; the
Triton kernels, which cannot cap scores, refuse the model at start.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from attention_ref import dense_attention, random_caches, sequence_kv
from test_model_equality import (
    MiniPlanner,
    _random_prompts,
    compare,
    hf_greedy,
    run_with_preemptions,
)
from test_sliding_window import check_prefix_hits_and_preemption

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.kernels import attention, cpu_ext
from subway.kernels.attention import (
    build_metadata,
    decode_attention_torch,
    paged_attention,
    positions_and_slots,
)

import reference
from conftest import GEMMA2_CAPS, GEMMA2_WINDOW, build_tiny_model

ext = cpu_ext.load()
needs_ext = pytest.mark.skipif(ext is None, reason="no C++ compiler: the reference is used")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SHAPES = [(9, 3, 64), (4, 1, 128), (8, 2, 32), (4, 1, 256), (6, 2, 24)]  # 24: generic only
WINDOWS = [0, 5, 21]  # none; shorter than a block; not a multiple of one
CONTEXTS = [[1, 15, 16, 17, 33, 64, 100, 250], [300]]  # [300]: one sequence (AVX2's few-row)
CAP = 3.0  # the kernel tests' cap; their queries are scaled so that scores reach past it
Q_GAIN = 3.0


# ------------------------------------------------------------------ the kernels


def check_decode(kernels, dtype, shape, block_size, contexts, window, kv_int8=False) -> None:
    """`kernels.paged_decode` (fast and generic) and `decode_attention_torch` with
    `softcap=CAP` (and `window`) against `dense_attention`, and not against it uncapped;
    `kernels`: a build of the CPU kernels (None: the torch reference only)."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(window * 7 + len(contexts) + head_dim)
    rng = np.random.default_rng(window)
    ctx = np.array(contexts, dtype=np.int64)
    max_blocks, num_blocks = int(-(-ctx.max() // block_size)), 200
    tables = rng.permutation(num_blocks)[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks)
    tables = tables.astype(np.int32)
    kc, vc, kf, vf = random_caches(dtype, kv_heads, head_dim, block_size, num_blocks, gen, kv_int8)
    q = (torch.randn(len(ctx), heads, head_dim, generator=gen) * Q_GAIN).to(dtype)
    ones = np.ones(len(ctx), dtype=np.int64)
    _, slots = positions_and_slots(ones, ctx, tables, block_size)
    md = build_metadata(ones, ctx, tables, slots, block_size, "cpu", (window,) if window else ())
    scale = head_dim**-0.5
    kv = [sequence_kv(kf, vf, tables[i], c) for i, c in enumerate(ctx.tolist())]

    def dense(cap: float) -> torch.Tensor:
        return torch.cat([
            dense_attention(q[i : i + 1], *kv[i], [c - 1], window, scale, cap)
            for i, c in enumerate(ctx.tolist())
        ])  # fmt: skip

    want, uncapped = dense(CAP), dense(0.0)
    assert (want - uncapped).abs().max() > 0.05  # the cap matters here
    kr, vr = (kc, vc) if kv_int8 else (kf, vf)
    ref = decode_attention_torch(q.float(), kr, vr, md, scale, window, CAP)
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=2e-5)
    if kernels is None:
        return
    if window:
        w = md.windows[window]
        tables_t, lens, skip = w.decode_tables, w.decode_lens, w.decode_skip
    else:
        tables_t, lens, skip = (
            torch.from_numpy(tables),
            torch.from_numpy(ctx.astype(np.int32)),
            None,
        )
    for generic in (False, True):
        out = kernels.paged_decode(q, kc, vc, tables_t, lens, scale, generic, skip, CAP)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
        plain = kernels.paged_decode(q, kc, vc, tables_t, lens, scale, generic, skip)
        assert torch.equal(plain, kernels.paged_decode(q, kc, vc, tables_t, lens, scale, generic,
                                                       skip, 0.0))  # fmt: skip
        assert (plain.float() - want).abs().max() > 0.05


def check_tanh(kernels) -> None:
    """The kernels' soft-capping (its vector tanh, and its scalar one) against float64:
    a relative error below 5e-7 of the capped value (float32 torch.tanh's: 1.6e-7), near
    0, across the polynomial's edge (|x| = 0.25), and where tanh saturates; lengths off
    the vectors' widths."""
    x = torch.cat([
        torch.linspace(-400.0, 400.0, 100_003),
        torch.linspace(-1.0, 1.0, 20_001),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, 0.25 * CAP, -0.25 * CAP, 0.7499, 0.75]),
        torch.logspace(-8, 3, 5001), -torch.logspace(-8, 3, 4999),
    ])  # fmt: skip
    want = torch.tanh(x.double() / CAP) * CAP
    for scalar in (False, True):
        for n in (len(x), 7, 13, 17):
            got = x[:n].clone()
            kernels.softcap_rows(got, CAP, scalar)
            err = (got.double() - want[:n]).abs() / want[:n].abs().clamp_min(1e-30)
            err[want[:n] == 0] = got[want[:n] == 0].abs().double()
            assert err.max() < 5e-7, (scalar, n, x[:n][err.argmax()], err.max())
    with pytest.raises(RuntimeError):
        kernels.softcap_rows(torch.zeros(4), 0.0, False)


@needs_ext
def test_the_kernels_tanh_is_accurate():
    check_tanh(ext)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kv_int8", [False, True], ids=["cache", "int8-cache"])
def test_decode_kernel_caps_as_the_dense_reference(dtype, shape, window, kv_int8):
    for block_size in (16, 32):
        for contexts in CONTEXTS:
            check_decode(ext, dtype, shape, block_size, contexts, window, kv_int8)


def test_the_reference_alone_caps_too():
    """Without the compiled kernels (`--no-cpu-ext`, or no compiler) the torch reference."""
    check_decode(None, torch.float32, (8, 2, 32), 4, [1, 3, 4, 5, 30, 77], 6)
    check_decode(None, torch.float32, (8, 2, 32), 4, [1, 3, 4, 5, 30, 77], 0)


@needs_ext
def test_a_negative_cap_is_refused():
    q, kc = torch.randn(1, 2, 16), torch.randn(4, 4, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="softcap"):
        ext.paged_decode(q, kc, kc, table, lens, 0.25, False, None, -1.0)


# (query length, context length): decodes, chunks that end a context, whole prompts.
MIXED = [(1, 40), (7, 40), (30, 30), (5, 100), (1, 3), (64, 64), (1, 1), (20, 57)]


@pytest.mark.parametrize("window", [0, 5, 21])
@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled-decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [attention.CAPPED_TILE, 700], ids=["one-tile", "tiles"])
def test_a_mixed_batch_caps_as_the_dense_reference(window, compiled, dtype, tile, monkeypatch):
    """Prefill chunks (computed explicitly, in tiles of queries when they are many) beside
    decodes, against float64; without a cap the chunks stay with SDPA."""
    if compiled and ext is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(attention, "CAPPED_TILE", tile)
    gen = torch.Generator().manual_seed(window)
    bs, heads, kv_heads, d, num_blocks = 8, 6, 2, 32, 120
    qlens = np.array([m for m, _ in MIXED], dtype=np.int64)
    ctx = np.array([c for _, c in MIXED], dtype=np.int64)
    max_blocks = int(-(-ctx.max() // bs))
    perm = np.random.default_rng(0).permutation(num_blocks)
    tables = perm[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks).astype(np.int32)
    kc, vc, kf, vf = random_caches(dtype, kv_heads, d, bs, num_blocks, gen, False)
    q = (torch.randn(int(qlens.sum()), heads, d, generator=gen) * Q_GAIN).to(dtype)
    _, slots = positions_and_slots(qlens, ctx, tables, bs)
    md = build_metadata(qlens, ctx, tables, slots, bs, "cpu", (window,) if window else ())
    out = paged_attention(q, kc, vc, md, d**-0.5, ext if compiled else None, window, CAP)
    assert out.dtype == dtype
    start, tol = 0, 3e-5 if dtype == torch.float32 else 2e-2
    for i, (m, c) in enumerate(MIXED):
        keys, values = sequence_kv(kf, vf, tables[i], c)
        rows = range(c - m, c)
        want = dense_attention(q[start : start + m], keys, values, rows, window, d**-0.5, CAP)
        torch.testing.assert_close(out[start : start + m].float(), want, atol=tol, rtol=tol)
        start += m

    def refuse(*args):
        raise AssertionError("soft-capped attention without a cap")

    monkeypatch.setattr(attention, "_capped_attention", refuse)
    plain = paged_attention(q, kc, vc, md, d**-0.5, ext if compiled else None, window)
    assert (plain.float() - out.float()).abs().max() > 0.05


AVX2_CHECK = """
import os, sys
import torch
from torch.utils import cpp_extension
from subway.kernels import cpu_ext
sys.path.insert(0, sys.argv[2])
cpu_ext.load = lambda: None  # the native build's ops must not register beside this one's
from test_gemma2 import CONTEXTS, SHAPES, WINDOWS, check_decode, check_tanh

ext = cpp_extension.load(
    name="subway_cpu_kernels_avx2", sources=[os.path.join(cpu_ext.CSRC, f) for f in cpu_ext.SOURCES],
    extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"],
    extra_ldflags=["-fopenmp"], build_directory=sys.argv[1])
assert ext.has_avx2() and not ext.has_avx512()
check_tanh(ext)
torch.set_num_threads(2)  # one sequence of 3 KV heads or 1: the few-row variant
for dtype in (torch.float32, torch.bfloat16):
    for shape in SHAPES:
        for window in WINDOWS:
            for kv_int8 in (False, True):
                for bs in (16, 32):
                    for contexts in CONTEXTS:
                        check_decode(ext, dtype, shape, bs, contexts, window, kv_int8)
print("avx2 ok")
"""


@pytest.mark.slow
def test_avx2_paths_cap_as_the_dense_reference():
    """The AVX2 kernels (per item, few-row, int8) are compiled out where the machine has
    AVX-512: a build without it (test_sliding_window's), in a process of its own."""
    from subway.cache_dir import kernel_build_dir

    with open("/proc/cpuinfo") as f:
        flags = f.read().replace("\n", " ")
    if not all(f" {x} " in flags for x in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU has no AVX2")
    build = kernel_build_dir(cpu_ext.CSRC) + "-avx2"
    os.makedirs(build, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK, build, here], capture_output=True,
                       text=True, timeout=1200)  # fmt: skip
    assert r.returncode == 0 and "avx2 ok" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------ the model

BLOCK_SIZE = 16  # the window (24) is not a multiple of it


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, default_model) -> str:
    return build_tiny_model("gemma2", str(tmp_path_factory.mktemp("gemma2")), default_model)


def _runner(path: str, **overrides):
    from subway.worker.runner import ModelRunner

    config = EngineConfig.build(path=path, block_size=BLOCK_SIZE, num_kv_blocks=1024, **overrides)
    return ModelRunner(config)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def test_the_config_is_read_and_the_caps_matter(gemma2):
    """The parsed architecture; transformers' own output changes when either cap is widened
    (the attention's: the tokens; the logits': their log-probabilities), so the tests below
    see both."""
    from transformers import AutoModelForCausalLM

    from subway.worker.model_arch import load_model_arch

    torch.set_num_threads(1)
    arch = load_model_arch(gemma2)
    assert (arch.family, arch.attn_softcap, arch.final_softcap) == ("gemma2", *GEMMA2_CAPS)
    assert arch.layer_types == ["sliding_attention", "full_attention"] * 2
    assert arch.sliding_window == GEMMA2_WINDOW and not arch.qk_norm
    assert arch.rope_local_theta == arch.rope_theta and arch.attn_scale == 24**-0.5
    prompts = _prompts([60, 33, 90, 10], seed=5)
    wide = AutoModelForCausalLM.from_pretrained(gemma2, attn_logit_softcapping=50.0).eval()
    got = [reference.hf_greedy(gemma2, p, 12).tokens for p in prompts]
    assert any(
        reference.model_greedy(wide, p, 12).tokens != g for p, g in zip(prompts, got, strict=True)
    )
    capped, raw = _hf_logprobs(gemma2, prompts[1] + got[1])
    assert (capped - raw).abs().max() > 0.5


def _hf_logprobs(path: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-softmax of each position's logits, capped (its output) and raw
    (the lm_head's, before the cap): `[len(tokens), vocab]` each."""
    model = reference.hf_model(path)
    with torch.no_grad():
        ids = torch.tensor([tokens])
        capped = model(ids).logits[0]
        raw = model.lm_head(model.model(ids).last_hidden_state)[0]
    return capped.log_softmax(-1), raw.log_softmax(-1)


@pytest.mark.parametrize("cpu_ext", [True, False], ids=["compiled", "reference"])
def test_greedy_matches_transformers(gemma2, cpu_ext):
    """Prompts up to 4x the window, arriving over steps; prefill in chunks of a 20-token
    budget beside decodes; two sequences preempted mid-decode and recomputed. Each kept
    token's logprob is transformers' log-softmax of the capped logits, not of the raw."""
    torch.set_num_threads(1)
    runner = _runner(gemma2, cpu_ext=cpu_ext)
    model = runner.model
    assert type(model).__name__ == "Gemma2CausalLM" and model.fused_decode is None
    assert [layer.self_attn.window for layer in model.layers] == [GEMMA2_WINDOW, 0] * 2
    assert model.layers[0].self_attn.q_norm is None
    prompts = _random_prompts(runner.vocab_size, [70, 5, 30, 96, 23, 48, 3], seed=11)
    max_new = 14
    planner = MiniPlanner(budget=20, block_size=BLOCK_SIZE, groups=runner.pages.num_groups)
    for i, p in enumerate(prompts):
        planner.add(p, max_new, arrival=i // 2)
    logprobs = run_with_preemptions(planner, runner, at=(12, 19))
    assert compare(planner, hf_greedy(gemma2, prompts, max_new)) == 0
    for sid, s in planner.seqs.items():
        capped, raw = _hf_logprobs(gemma2, s.tokens)
        rows = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
        ids = torch.tensor(s.generated)
        ours = torch.tensor(logprobs[sid], dtype=torch.float64)
        torch.testing.assert_close(ours, capped[rows, ids].double(), atol=1e-4, rtol=0)
        assert (ours - raw[rows, ids].double()).abs().max() > 1e-2


def test_the_caps_change_what_the_runner_computes(gemma2, tmp_path):
    """The same weights with the caps widened to 1000 (as good as none): other tokens or
    other logprobs (so neither cap is a no-op in the runner)."""
    import json
    import shutil

    torch.set_num_threads(1)
    prompts = _random_prompts(49152, [60, 33, 90], seed=5)
    outs = {}
    widened = (("capped", None), ("wide_attn", (1000.0, None)), ("wide_final", (None, 1000.0)))
    for name, caps in widened:
        path = gemma2
        if caps is not None:
            path = str(tmp_path / name)
            shutil.copytree(gemma2, path)
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            cfg["attn_logit_softcapping"] = caps[0] or cfg["attn_logit_softcapping"]
            cfg["final_logit_softcapping"] = caps[1] or cfg["final_logit_softcapping"]
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f)
        runner = _runner(path)
        planner = MiniPlanner(budget=64, block_size=BLOCK_SIZE, groups=runner.pages.num_groups)
        for p in prompts:
            planner.add(p, 12)
        outs[name] = (
            run_with_preemptions(planner, runner, at=()),
            [s.generated for s in planner.seqs.values()],
        )
    assert outs["wide_attn"][1] != outs["capped"][1]
    assert outs["wide_final"][1] == outs["capped"][1]  # tanh keeps the order: same tokens
    capped, wide = outs["capped"][0], outs["wide_final"][0]
    diffs = [abs(a - b) for sid in capped for a, b in zip(capped[sid], wide[sid], strict=True)]
    assert max(diffs) > 0.1


def _the_attention_cap_matters(path: str, prompts: list[list[int]], max_new: int) -> bool:
    """Whether transformers' greedy tokens of every prompt change with the attention's cap
    widened to 1000 (as good as none): prompts on which an uncapped attention shows."""
    from transformers import AutoModelForCausalLM

    wide = AutoModelForCausalLM.from_pretrained(path, attn_logit_softcapping=1000.0).eval()
    return all(
        reference.model_greedy(wide, p, max_new).tokens
        != reference.hf_greedy(path, p, max_new).tokens
        for p in prompts
    )


def test_prefix_cache_hits_and_preemption_through_the_scheduler(gemma2):
    """The same long prompt twice, the second reading the first's blocks from the cache;
    a pool so small that sequences preempt each other (`check_prefix_hits_and_preemption`),
    on prompts where the attention cap changes the output."""
    torch.set_num_threads(1)
    rng = random.Random(11)
    long = [rng.randrange(3, 49152) for _ in range(75)]
    mid, short = _prompts([40, 9], seed=12)
    assert _the_attention_cap_matters(gemma2, [long, long[:52] + short], 12)
    small = -(-(75 + 12) // BLOCK_SIZE) + 2  # a sequence's blocks and 2 more
    check_prefix_hits_and_preemption(gemma2, BLOCK_SIZE, (long, mid, short), small)


def test_speculative_drafts_are_capped_too(gemma2):
    """n-gram drafts are verified as one-token rows (decodes, capped) past the window."""
    from subway.llm import LLM

    torch.set_num_threads(1)
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    engine = LLM(path=gemma2, speculative_config=ngram, block_size=BLOCK_SIZE, threads=1)
    rng = random.Random(14)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] * 3 for n in (11, 17)]
    max_new = 24
    assert _the_attention_cap_matters(gemma2, prompts, max_new)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = engine.generate(prompts, sp)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference.hf_greedy(gemma2, p, max_new).tokens
    assert engine.scheduler.engine_stats().spec_draft_tokens_total > 0


# ------------------------------------------------------------------ where it runs


def test_the_triton_kernels_refuse_attention_soft_capping():
    """The Triton kernels (CUDA) have no soft-capping: a Gemma 2 whose scores are capped is
    refused at start, by the field's name; one without the cap, and Gemma 3, are built."""
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.families import build_model, check_kernels
    from subway.worker.model_arch import parse_model_arch
    from subway.worker.parallel import TensorParallel

    cfg = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
               hidden_activation="gelu_pytorch_tanh", architectures=["Gemma2ForCausalLM"],
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # fmt: skip
    arch = parse_model_arch(cfg)
    cpu = choose_kernels("torch", False, "cpu")
    triton = dataclasses.replace(cpu, name="triton")
    args = (TensorParallel(0, 1), torch.float32, torch.device("cpu"), 64)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0.*Triton"):
        build_model(arch, *args, triton)
    check_kernels(arch, cpu)
    assert type(build_model(arch, *args, cpu)).__name__ == "Gemma2CausalLM"
    no_cap = parse_model_arch({**cfg, "attn_logit_softcapping": None})
    assert no_cap.attn_softcap == 0.0 and no_cap.final_softcap == 30.0
    check_kernels(no_cap, triton)
    no_caps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    gemma3 = parse_model_arch({**cfg, **no_caps, "architectures": ["Gemma3ForCausalLM"]})
    check_kernels(gemma3, triton)


@needs_ext
def test_fused_decode_stays_off(gemma2):
    """The compiled whole-step decode runs Llama's layers, uncapped: never Gemma 2's (in
    bfloat16, where it would otherwise be considered)."""
    from subway.worker.fused_decode import FusedDecode

    runner = _runner(gemma2, dtype="bfloat16")
    model = runner.model
    assert model.fused_decode is None
    model.windows = ()
    assert FusedDecode.build(model) is None
