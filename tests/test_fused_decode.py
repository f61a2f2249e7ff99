"""Fused decode (worker/fused_decode.py FusedDecode, decode_layers_cpu.cpp): every layer of a small
decode step in one compiled call must give the Python loop's bits, not nearly them."""

from __future__ import annotations

import random

import pytest

from subway.ipc.messages import SamplingParams
from subway.kernels import cpu_ext

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(
    ext is None or not ext.small_linear_supported(),
    reason="the C++ kernels with the few-row linear (AVX512-BF16 or AVX2): fused decode is theirs",
)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _counting(model) -> list[int]:  # noqa: ANN001
    """Wrap the model's fused call; the list gets each call's row count."""
    fused, rows = model.fused_decode, []
    inner = fused.call

    def call(h, *rest):  # noqa: ANN001, ANN002, ANN202
        rows.append(h.shape[0])
        return inner(h, *rest)

    fused.call = call
    return rows


def _generate(llm, prompts, fused, max_tokens: int = 20):  # noqa: ANN001, ANN202
    saved = llm.runner.model.fused_decode
    if not fused:
        llm.runner.model.fused_decode = None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    finally:
        llm.runner.model.fused_decode = saved


@pytest.mark.parametrize(
    "arch,kv",
    [("llama", "auto"), ("qwen2", "auto"), ("llama", "int8")],  # qwen2: biases in qkv
)
def test_fused_decode_gives_the_python_loops_bits(tiny_models, arch, kv):
    """Greedy tokens and their logprobs (so the logits, to the bit) are the same with and
    without the fused call: one and three sequences (where it runs), one more than
    `small_linear_rows` (where it does not, but for the last steps), and it did run."""
    from subway.llm import LLM

    limit = cpu_ext.load().small_linear_rows()  # the most rows it takes (4, 16 or 32)
    llm = LLM(path=tiny_models[arch], dtype="bfloat16", kv_cache_dtype=kv, block_size=16,
              num_kv_blocks=512, max_num_seqs=limit + 1,
              enable_prefix_caching=False)  # fmt: skip
    # No prefix cache: the second run of the same prompts would prefill fewer tokens, and
    # past `limit` rows oneDNN's float32 matmul rounds by its row count.
    model = llm.runner.model
    assert model.fused_decode is not None
    rows = _counting(model)
    for n, seed in ((1, 0), (3, 1), (limit + 1, 2)):
        prompts = _prompts(llm.runner.vocab_size, [5 + 9 * i for i in range(n)], seed)
        fused = _generate(llm, prompts, fused=True)
        calls = len(rows)
        plain = _generate(llm, prompts, fused=False)
        assert len(rows) == calls  # switched off: not called
        assert fused == plain, (arch, kv, n)
    assert rows and max(rows) <= limit and {1, 3} <= set(rows)


def _int8_refused() -> str | None:
    from subway.ipc.config import EngineConfig
    from subway.worker.quant import unsupported_reason

    return unsupported_reason(EngineConfig.build(quantization="int8", device="cpu"))


@pytest.mark.skipif(_int8_refused() is not None, reason="int8 weights refused on this CPU")
@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("qwen2", "int8")])
def test_fused_decode_under_int8_gives_the_python_loops_bits(tiny_models, arch, kv):
    """`--quantization int8`: each linear is Int8Linear's call (quantize the rows, the AVX2
    or AMX int8 matmul) inside the fused call. The same tokens and logprobs with and without
    it, at 1, 3 and 20 sequences: int8 steps of any size are fused (the int8 matmuls take
    any row count). Where the int8 matmul is oneDNN's (no AVX2) the loop stays."""
    from subway.llm import LLM
    from subway.worker.quant import choose_path, int8_ops

    llm = LLM(path=tiny_models[arch], dtype="bfloat16", quantization="int8", kv_cache_dtype=kv,
              block_size=16, num_kv_blocks=512, max_num_seqs=20,
              enable_prefix_caching=False)  # fmt: skip
    model = llm.runner.model
    path = choose_path(int8_ops(), model.arch.hidden_size)
    if path == "onednn":
        assert model.fused_decode is None
        return
    assert model.fused_decode is not None and model.fused_decode.int8_path in (1, 2, 3)
    rows = _counting(model)
    for n, seed in ((1, 0), (3, 1), (20, 2)):
        prompts = _prompts(llm.runner.vocab_size, [5 + 7 * i for i in range(n)], seed)
        fused = _generate(llm, prompts, fused=True)
        plain = _generate(llm, prompts, fused=False)
        assert fused == plain, (arch, kv, n)
    assert {1, 3, 20} <= set(rows)


def test_fused_decode_is_off_where_it_would_differ(tiny_models):
    """Qwen3's q/k norms and float32 models (no few-row kernel) keep the Python loop."""
    from subway.llm import LLM

    assert LLM(path=tiny_models["qwen3"], dtype="bfloat16").runner.model.fused_decode is None
    assert LLM(path=tiny_models["llama"], dtype="float32").runner.model.fused_decode is None


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fused_decode_on_the_default_model(default_model, quantization):
    """The default model, bfloat16 (and int8 weights where this CPU takes them), one and four
    sequences: the same tokens and logprobs."""
    from subway.llm import LLM

    if quantization and _int8_refused():
        pytest.skip("int8 weights refused on this CPU")
    llm = LLM(path=default_model, dtype="bfloat16", max_num_seqs=4, enable_prefix_caching=False,
              quantization=quantization)  # fmt: skip
    prompts = _prompts(llm.runner.vocab_size, [7, 30, 12, 60], seed=5)
    for group in (prompts[:1], prompts):
        assert _generate(llm, group, fused=True, max_tokens=12) == _generate(
            llm, group, fused=False, max_tokens=12
        )
