"""Sliding-window attention on the CPU path: a query at position i attends to key j iff
j <= i and i - j < W (transformers' `sliding_window_overlay`).

Kernel level: the compiled decode kernel (its fast path and its generic one; the int8
cache's; the AVX2 build's, few-row variant included, in the slow tier) on a window's
shifted block tables and `skip`, and the PyTorch reference (decodes and prefill chunks),
against attention computed densely with the window's mask. Model level: tiny random
Gemma 3 (sliding layers and a global one) and Mistral (every layer slides) models greedy
as transformers, with prompts longer than the window, several requests in flight, chunked
prefill, a prefix-cache hit, preemption and speculative drafts.
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
from test_model_equality import MiniPlanner, compare, hf_greedy, run_with_preemptions

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.kernels import cpu_ext
from subway.kernels.attention import (
    build_metadata,
    decode_attention_torch,
    paged_attention,
    positions_and_slots,
)

import reference

ext = cpu_ext.load()
needs_ext = pytest.mark.skipif(ext is None, reason="no C++ compiler: the reference is used")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SHAPES = [(9, 3, 64), (4, 1, 128), (8, 2, 32), (4, 4, 16), (6, 2, 24)]  # 24: generic only
# Smaller than a block, not a multiple of it, a multiple of it, longer than every context.
WINDOWS = [1, 5, 21, 32, 1000]
CONTEXTS = [[1, 15, 16, 17, 33, 64, 100, 250], [300]]  # [300]: one sequence (AVX2's few-row)


# ------------------------------------------------------------------ the kernels


def check_decode(kernels, dtype, shape, block_size, contexts, window, kv_int8=False) -> None:
    """`kernels.paged_decode` (fast and generic) and `decode_attention_torch` with `window`
    against `dense_attention`; `kernels`: a build of the CPU kernels (or None: the torch
    reference only)."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(window * 7 + len(contexts))
    rng = np.random.default_rng(window)
    ctx = np.array(contexts, dtype=np.int64)
    max_blocks, num_blocks = int(-(-ctx.max() // block_size)), 200
    tables = rng.permutation(num_blocks)[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks)
    tables = tables.astype(np.int32)
    kc, vc, kf, vf = random_caches(dtype, kv_heads, head_dim, block_size, num_blocks, gen, kv_int8)
    q = torch.randn(len(ctx), heads, head_dim, generator=gen).to(dtype)
    ones = np.ones(len(ctx), dtype=np.int64)
    _, slots = positions_and_slots(ones, ctx, tables, block_size)
    md = build_metadata(ones, ctx, tables, slots, block_size, "cpu", (window,))
    scale = head_dim**-0.5
    kv = [sequence_kv(kf, vf, tables[i], c) for i, c in enumerate(ctx.tolist())]
    want = torch.cat([
        dense_attention(q[i : i + 1], *kv[i], [c - 1], window, scale)
        for i, c in enumerate(ctx.tolist())
    ])  # fmt: skip
    kr, vr = (kc, vc) if kv_int8 else (kf, vf)  # the reference reads an int8 cache too
    ref = decode_attention_torch(q.float(), kr, vr, md, scale, window)
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=2e-5)
    if kernels is None:
        return
    w = md.windows[window]
    skip = np.maximum(ctx - window, 0) % block_size  # the first kept block's keys before it
    assert (w.decode_skip is None) if not skip.any() else (w.decode_skip.numpy() == skip).all()
    for generic in (False, True):
        out = kernels.paged_decode(
            q, kc, vc, w.decode_tables, w.decode_lens, scale, generic, w.decode_skip
        )
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kv_int8", [False, True], ids=["cache", "int8-cache"])
def test_decode_kernel_slides_as_the_dense_mask(dtype, shape, window, kv_int8):
    for block_size in (16, 32):
        for contexts in CONTEXTS:
            check_decode(ext, dtype, shape, block_size, contexts, window, kv_int8)


def test_the_reference_alone_slides_too():
    """Without the compiled kernels (`--no-cpu-ext`, or no compiler) the torch reference."""
    check_decode(None, torch.float32, (8, 2, 32), 4, [1, 3, 4, 5, 30, 77], 6)


@needs_ext
def test_a_bad_skip_is_refused():
    q, kc = torch.randn(1, 2, 16), torch.randn(4, 4, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    for bad in (torch.tensor([3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                torch.tensor([-1], dtype=torch.int32), torch.tensor([1])):  # fmt: skip
        with pytest.raises(RuntimeError):
            ext.paged_decode(q, kc, kc, table, lens, 0.25, False, bad)
    plain = ext.paged_decode(q, kc, kc, table, lens, 0.25)
    none_skipped = torch.zeros(1, dtype=torch.int32)
    assert torch.equal(ext.paged_decode(q, kc, kc, table, lens, 0.25, False, none_skipped), plain)


# (query length, context length): decodes, chunks that end a context, whole prompts.
MIXED = [(1, 40), (7, 40), (30, 30), (5, 100), (1, 3), (64, 64), (1, 1), (20, 57)]


@pytest.mark.parametrize("window", [0, 5, 21, 32, 1000])
@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled-decode"])
@pytest.mark.parametrize("kv_int8", [False, True], ids=["cache", "int8-cache"])
def test_a_mixed_batch_slides_as_the_dense_mask(window, compiled, kv_int8):
    """Prefill chunks (reading from the first block their queries need) beside decodes."""
    if compiled and ext is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(window)
    bs, heads, kv_heads, d, num_blocks = 8, 6, 2, 32, 120
    qlens = np.array([m for m, _ in MIXED], dtype=np.int64)
    ctx = np.array([c for _, c in MIXED], dtype=np.int64)
    max_blocks = int(-(-ctx.max() // bs))
    perm = np.random.default_rng(0).permutation(num_blocks)
    tables = perm[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks).astype(np.int32)
    kc, vc, kf, vf = random_caches(torch.float32, kv_heads, d, bs, num_blocks, gen, kv_int8)
    q = torch.randn(int(qlens.sum()), heads, d, generator=gen)
    _, slots = positions_and_slots(qlens, ctx, tables, bs)
    md = build_metadata(qlens, ctx, tables, slots, bs, "cpu", (window,) if window else ())
    out = paged_attention(q, kc, vc, md, d**-0.5, ext if compiled else None, window)
    start = 0
    for i, (m, c) in enumerate(MIXED):
        keys, values = sequence_kv(kf, vf, tables[i], c)
        want = dense_attention(q[start : start + m], keys, values, range(c - m, c), window,
                               d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[start : start + m], want, atol=3e-5, rtol=3e-5)
        start += m
    if window:  # a chunk past the window reads from its first block in it, not from 0
        chunks = [(m, c) for m, c in MIXED if m > 1]
        first = {mc: f for mc, (f, _) in zip(chunks, md.windows[window].prefills, strict=True)}
        assert first[5, 100] == max(0, 95 - window + 1) // bs


AVX2_CHECK = """
import os, sys
import torch
from torch.utils import cpp_extension
from subway.kernels import cpu_ext
sys.path.insert(0, sys.argv[2])
cpu_ext.load = lambda: None  # the native build's ops must not register beside this one's
from test_sliding_window import CONTEXTS, SHAPES, WINDOWS, check_decode

ext = cpp_extension.load(
    name="subway_cpu_kernels_avx2", sources=[os.path.join(cpu_ext.CSRC, f) for f in cpu_ext.SOURCES],
    extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"],
    extra_ldflags=["-fopenmp"], build_directory=sys.argv[1])
assert ext.has_avx2() and not ext.has_avx512()
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
def test_avx2_paths_slide_as_the_dense_mask():
    """The AVX2 kernels (per item, few-row, int8) are compiled out where the machine has
    AVX-512: a build without it, in a process of its own (kept beside the native build)."""
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


# ------------------------------------------------------------------ the models

GEMMA_WINDOW, MISTRAL_WINDOW = 24, 21
# kind -> (block size, window): Gemma's window not a multiple of its blocks, nor Mistral's.
KINDS = {"gemma3": (16, GEMMA_WINDOW), "mistral": (4, MISTRAL_WINDOW)}


def build_windowed_model(kind: str, out_dir: str, tokenizer_dir: str) -> str:
    """A tiny random model with a sliding window shorter than the tests' prompts
    (conftest's `build_tiny_model`, with windows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, MistralConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    if kind == "gemma3":  # sliding layers on both sides of a global one
        kinds = ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
        config = Gemma3TextConfig(**common, num_hidden_layers=4, head_dim=32,
                                  query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
                                  layer_types=kinds)  # fmt: skip
        config.architectures = ["Gemma3ForCausalLM"]
    else:
        config = MistralConfig(**common, num_hidden_layers=2, sliding_window=MISTRAL_WINDOW)
        config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wide weights: decisive greedy choices, not near-ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind == "gemma3" else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.05)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, default_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("windowed")
    return {k: build_windowed_model(k, str(root / k), default_model) for k in KINDS}


def _runner(path: str, block_size: int, **overrides):
    from subway.worker.runner import ModelRunner

    config = EngineConfig.build(path=path, block_size=block_size, num_kv_blocks=1024, **overrides)
    return ModelRunner(config)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_transformers_reference_slides(windowed):
    """The reference: transformers' cached generate (as `reference.hf_greedy` runs it) gives
    what an uncached eager forward with the sliding mask gives, and the window changes the
    output (so the tests below see it)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    for kind, path in windowed.items():
        prompts = _prompts(49152, [60, 33], seed=5)
        eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        wide = AutoModelForCausalLM.from_pretrained(path, sliding_window=4096).eval()
        differ = False
        for p in prompts:
            got = reference.hf_greedy(path, p, 10).tokens
            with torch.no_grad():
                logits = eager(torch.tensor([p + got])).logits[0]
            assert logits[len(p) - 1 : -1].argmax(-1).tolist() == got, kind
            differ |= reference.model_greedy(wide, p, 10).tokens != got
        assert differ, f"{kind}: its window does not change the output"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cpu_ext", [True, False], ids=["compiled", "reference"])
def test_greedy_matches_transformers_past_the_window(windowed, kind, cpu_ext):
    """Prompts up to 4x the window, arriving over steps; prefill in chunks of a 20-token
    budget (chunks that start before and end past a window's edge) beside decodes; two
    sequences preempted mid-decode and recomputed."""
    torch.set_num_threads(1)
    path = windowed[kind]
    block_size, window = KINDS[kind]
    runner = _runner(path, block_size, cpu_ext=cpu_ext)
    assert runner.max_model_len == 2048  # no cap at the window on the CPU
    assert runner.model.windows == (window,)
    slides = [layer.self_attn.window for layer in runner.model.layers]
    assert slides == ([window, window, 0, window] if kind == "gemma3" else [window] * 2)
    prompts = _prompts(runner.vocab_size, [70, 5, 30, 96, 23, 48, 3], seed=11)
    max_new = 14
    planner = MiniPlanner(budget=20, block_size=block_size, groups=runner.pages.num_groups)
    for i, p in enumerate(prompts):
        planner.add(p, max_new, arrival=i // 2)
    run_with_preemptions(planner, runner, at=(12, 19))  # (asserts each preempts one)
    assert compare(planner, hf_greedy(path, prompts, max_new)) == 0


def check_prefix_hits_and_preemption(
    path: str, block_size: int, prompts: tuple[list[int], list[int], list[int]], small: int
) -> None:
    """Through the real scheduler (float32, as transformers runs): a
    long prompt, then it again beside a prompt sharing its start and two others (the
    second reads the first's blocks from the cache), chunked under a 16-token budget, with
    1024 blocks and with `small` ones, where sequences preempt each other; greedy output
    equal to transformers' each time."""
    from subway.llm import LLM

    long, mid, short = prompts
    waves = [[long], [long, long[:52] + short, mid, short]]
    max_new = 12
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    want = [reference.hf_greedy(path, p, max_new).tokens for wave in waves for p in wave]
    for blocks in (1024, small):
        config = EngineConfig.build(
            path=path, run_id="sw", block_size=block_size, max_num_seqs=8, threads=1,
            enable_prefix_caching=True, num_kv_blocks=blocks, max_num_batched_tokens=16,
        )  # fmt: skip
        engine = LLM(config)
        got = [o.token_ids for wave in waves for o in engine.generate(wave, sp, overlap=False)]
        assert got == want, blocks
        stats = engine.scheduler.engine_stats()
        if blocks == 1024:  # the second long prompt: all its full blocks but the last
            n = len(long)
            assert stats.prefix_cache_hits_total >= n // block_size * block_size - block_size
        else:
            assert stats.num_preempted_total > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefix_cache_hits_and_preemption_through_the_scheduler(windowed, kind):
    """The same long prompt twice, its blocks before and inside the window read from the
    cache; a pool so small that sequences preempt each other
    (`check_prefix_hits_and_preemption`)."""
    torch.set_num_threads(1)
    block_size, _ = KINDS[kind]
    rng = random.Random(3)
    long = [rng.randrange(3, 49152) for _ in range(75)]
    mid, short = _prompts(49152, [40, 9], seed=4)
    # The small pool: a sequence's blocks and 2 more. Mistral's one sliding group holds at
    # most its window and a chunk: 11 blocks of 4 hold one sequence, and no more.
    blocks_each = -(-(75 + 12) // block_size)
    small = blocks_each + 2 if kind == "gemma3" else 11
    check_prefix_hits_and_preemption(windowed[kind], block_size, (long, mid, short), small)


@pytest.mark.parametrize("kind", list(KINDS))
def test_speculative_drafts_slide_too(windowed, kind):
    """n-gram drafts are verified as one-token rows past the window."""
    from subway.llm import LLM

    torch.set_num_threads(1)
    path = windowed[kind]
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    engine = LLM(path=path, speculative_config=ngram, block_size=KINDS[kind][0], threads=1)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] * 3 for n in (11, 17)]
    max_new = 24
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = engine.generate(prompts, sp)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference.hf_greedy(path, p, max_new).tokens
    assert engine.scheduler.engine_stats().spec_draft_tokens_total > 0


# ------------------------------------------------------------------ where windows run


def test_the_window_caps_max_model_len_only_where_layers_do_not_slide():
    """On the CPU the layers slide: no cap. Under the Triton kernels (CUDA), which have no
    windows, and for Qwen2's windows (transformers slides only some layers), sequences stay
    inside the window."""
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.model import layer_windows, max_model_len
    from subway.worker.model_arch import parse_model_arch

    base = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=24)  # fmt: skip
    mistral = parse_model_arch({**base, "architectures": ["MistralForCausalLM"]})
    gemma = parse_model_arch({**base, "architectures": ["Gemma3ForCausalLM"], "head_dim": 16,
                              "hidden_activation": "gelu_pytorch_tanh",
                              "sliding_window_pattern": 2})  # fmt: skip
    qwen2 = parse_model_arch({**base, "architectures": ["Qwen2ForCausalLM"],
                              "use_sliding_window": True})  # fmt: skip
    plain = parse_model_arch(
        {**base, "architectures": ["LlamaForCausalLM"], "sliding_window": None}
    )
    cpu = choose_kernels("torch", True, "cpu")
    triton = dataclasses.replace(cpu, name="triton")
    assert layer_windows(mistral, cpu) == [24] * 4
    assert layer_windows(gemma, cpu) == [24, 0, 24, 0]
    assert layer_windows(qwen2, cpu) == [0] * 4
    for arch in (mistral, gemma):
        assert max_model_len(arch, cpu, 4096) == 4096
        assert layer_windows(arch, triton) == [0] * 4
        assert max_model_len(arch, triton, 4096) == 24
        assert max_model_len(arch, triton, 16) == 16
    assert max_model_len(qwen2, cpu, 4096) == 24
    assert max_model_len(plain, cpu, 4096) == max_model_len(plain, triton, 4096) == 4096
    # A Qwen config's own layer kinds (transformers writes them) slide those layers; with
    # none sliding there is no window at all. Llama's own model ignores `sliding_window`.
    kinds = ["full_attention"] * 2 + ["sliding_attention"] * 2
    qwen_kinds = parse_model_arch({**base, "architectures": ["Qwen2ForCausalLM"],
                                   "use_sliding_window": True, "layer_types": kinds})  # fmt: skip
    assert layer_windows(qwen_kinds, cpu) == [0, 0, 24, 24]
    assert max_model_len(qwen_kinds, cpu, 4096) == 4096
    qwen_none = parse_model_arch({**base, "architectures": ["Qwen2ForCausalLM"],
                                  "use_sliding_window": True,
                                  "layer_types": ["full_attention"] * 4})  # fmt: skip
    assert qwen_none.sliding_window is None and max_model_len(qwen_none, triton, 4096) == 4096
    llama = parse_model_arch({**base, "architectures": ["LlamaForCausalLM"]})
    assert llama.sliding_window is None and layer_windows(llama, cpu) == [0] * 4


@needs_ext
def test_fused_decode_stays_off_with_a_window(windowed):
    """The compiled whole-step decode attends globally: off for a windowed model (bfloat16
    Mistral, which it would take without its window)."""
    from subway.worker.fused_decode import FusedDecode

    if not ext.small_linear_supported():
        pytest.skip("no few-row linear here: FusedDecode is off for every model")
    runner = _runner(windowed["mistral"], 4, dtype="bfloat16")
    model = runner.model
    assert model.windows and model.fused_decode is None
    model.windows = ()  # the same model without its window takes it
    assert FusedDecode.build(model) is not None


def test_real_gemma3_270m_past_its_window(gemma3_270m):
    """Gemma 3 270M's real weights (15 of 18 layers sliding over 512 tokens, head_dim 256):
    a prompt of about 800 tokens, prefilled in chunks of 200 (one straddles the window's
    edge) beside a short prompt's decodes."""
    from test_model_equality import make_runner
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(gemma3_270m)
    text = " ".join(
        f"On day {i} the traveller walked {i % 7 + 2} miles north, counted {i * 3} birds "
        "and wrote it all down."
        for i in range(1, 41)
    )
    prompts = [
        tok(text + " On day 41 the traveller")["input_ids"],
        tok("Water boils at")["input_ids"],
    ]
    assert len(prompts[0]) > 600
    runner = make_runner(gemma3_270m)
    planner = MiniPlanner(budget=200, groups=runner.pages.num_groups)
    for p in prompts:
        planner.add(p, 12)
    planner.run(runner)
    assert compare(planner, hf_greedy(gemma3_270m, prompts, 12)) <= 1
