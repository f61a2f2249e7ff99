"""bfloat16 linears on float32 copies of their weights (`--bf16-matmul`, `layers.widen_bf16`):
the rule, the linear against the exact product, and greedy output against transformers."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernel import _ulps_bf16
from test_model_equality import LENGTHS, MiniPlanner, _random_prompts, compare, make_runner

from subway.worker.layers import PackedLinear, linear, pack_weight, widen_bf16

from reference import hf_greedy


def test_the_rule_follows_onednn_unless_told():
    assert widen_bf16("float32") is True
    assert widen_bf16("native") is False
    assert widen_bf16("auto") is (not torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("rows", [5, 48, 100])  # 100: padded to the row bucket
def test_the_widened_linear_is_within_one_ulp_of_the_exact_product(rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(960, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w.float(), 64)
    assert packed is not None
    for bias in (None, b):
        exact = x.double() @ w.double().T
        exact = (exact + b.double() if bias is not None else exact).to(torch.bfloat16)
        got = linear(x, w, bias, packed, wide=True)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 960)
        assert _ulps_bf16(got, exact) <= 1


def _generate(path: str, mode: str) -> MiniPlanner:
    runner = make_runner(path, dtype="bfloat16", bf16_matmul=mode)
    layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    wide = mode == "float32"
    assert layers and all(m.wide is wide for m in layers) and runner.model.lm_head_wide is wide
    if wide:
        assert all(m.packed.dtype == torch.float32 for m in layers)
    prompts = _random_prompts(runner.vocab_size, LENGTHS)
    planner = MiniPlanner(budget=48)
    for i, p in enumerate(prompts):
        planner.add(p, 12, arrival=i // 3)
    planner.run(runner)
    return planner


def test_bfloat16_greedy_output_is_the_same_widened_or_native(tiny_models):
    """The tiny Llama in bfloat16, batched and chunked (9 prompts, one of 150 tokens under a
    48-token budget): `float32` packs every linear and the lm_head as float32, `native` does
    not. Both agree with transformers' bfloat16 greedy decoding up to verified near-ties (a
    random tiny model's logits are nearly flat, and bfloat16 rounds them to ties), and the
    two give the same tokens."""
    torch.set_num_threads(1)
    path = tiny_models["llama"]
    wide, native = _generate(path, "float32"), _generate(path, "native")
    prompts = [s.tokens[: s.prompt_len] for s in native.seqs.values()]
    refs = [hf_greedy(path, p, 12, torch.bfloat16) for p in prompts]
    expected = [(r.tokens, r.top5) for r in refs]
    compare(wide, expected)  # asserts each divergence is a near-tie
    compare(native, expected)
    same = [wide.seqs[i].generated == native.seqs[i].generated for i in native.seqs]
    assert sum(same) >= len(same) - 1
