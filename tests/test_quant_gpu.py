"""The GPU's 8-bit linears (worker/quant_gpu.py), run on the CPU, where torch's
`_scaled_mm` and `_int_mm` run too: the arithmetic against exact and float references,
the shapes refused, and the default model with every linear in fp8 or int8 through them.
On a GPU, `tools/gpu_check.sh`'s quant section runs them on the tensor cores."""

from __future__ import annotations

import pytest
import torch
from test_quant import TEXTS, _agreement

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.llm import LLM
from subway.worker.layers import PackedLinear
from subway.worker.quant import unsupported_reason
from subway.worker.quant_gpu import ERROR_BOUND, INT_MM_MIN_ROWS, ScaledLinear, gpu_path

PATHS = ("fp8", "int8")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "rows,k,n", [(1, 64, 48), (5, 576, 192), (33, 1536, 576), (100, 576, 1536)]
)
def test_scaled_linear_against_float(path, rows, k, n):
    g = torch.Generator().manual_seed(rows + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        y = ScaledLinear(w.to(dtype), path)(x.to(dtype), b.to(dtype))
        assert y.dtype == dtype and y.shape == (rows, n)
        ref = x.to(dtype).float() @ w.to(dtype).float().t() + b.to(dtype).float()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < ERROR_BOUND[path], (path, dtype, err)


@pytest.mark.parametrize("path", PATHS)
def test_scales_go_to_rows_and_columns(path):
    """Integers each format holds exactly, each row and each channel scaled by its own power
    of two: every step is exact, so the output is the exact product (fp8's rounded once to
    bfloat16, _scaled_mm's output); a scale on the wrong axis or a lost pad row cannot pass."""
    top = 448.0 if path == "fp8" else 127.0  # each row's largest |value|
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-8, 9, (32, 64), generator=g).float()
    x = torch.randint(-8, 9, (INT_MM_MIN_ROWS + 3, 64), generator=g).float()
    w[:, 0], x[:, 0] = top, top
    w *= torch.tensor([2.0 ** (n % 7 - 3) for n in range(32)])[:, None]
    x *= torch.tensor([2.0 ** (i % 5 - 2) for i in range(x.shape[0])])[:, None]
    lin = ScaledLinear(w, path)
    for rows in (1, 3, x.shape[0]):  # padded to INT_MM_MIN_ROWS, then not
        exact = (x[:rows].double() @ w.double().t()).float()
        want = exact.to(torch.bfloat16).float() if path == "fp8" else exact
        assert torch.equal(lin(x[:rows]), want), (path, rows)


def test_shapes_the_8_bit_matmuls_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        ScaledLinear(torch.randn(30, 64), "int8")
    with pytest.raises(ValueError, match="unknown"):
        ScaledLinear(torch.randn(32, 64), "int4")
    assert gpu_path(torch.device("cpu")) == "int8"


def test_on_cuda_8_bit_weights_are_allowed_where_every_linear_fits(tmp_path, default_model):
    """Without the CPU kernels; a model with a linear of an odd size is refused at start,
    by its config alone. (The 8-bit cache's rules: tests/test_kv_int8.py.)"""
    import json
    import shutil

    def reason(path: str, tp: int = 1) -> str | None:
        config = EngineConfig.build(
            path=path, device="cuda", cpu_ext=False, quantization="int8", tensor_parallel_size=tp
        )
        return unsupported_reason(config)

    assert reason(default_model) is None  # hidden 576, intermediate 1536, 9 heads of 64
    odd = tmp_path / "odd"
    odd.mkdir()
    shutil.copy(f"{default_model}/config.json", odd / "config.json")
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 1544}))
    assert "multiples of 16" in reason(str(odd))
    # Whole, 1552 fits; split over two ranks, 776 a rank does not.
    (odd / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 1552}))
    assert reason(str(odd)) is None
    assert "tensor parallel 2" in reason(str(odd), tp=2)


def test_without_the_cpu_kernels_a_linear_is_quantized_through_torchs_ops():
    """`PackedLinear.quantize(None)`, as the runner calls it on a GPU: ScaledLinear."""
    lin = PackedLinear()
    lin.weight = torch.nn.Parameter(torch.randn(32, 64), requires_grad=False)
    lin.quantize(None)
    assert isinstance(lin.int8, ScaledLinear) and lin.int8.path == gpu_path(torch.device("cpu"))
    assert lin.weight.numel() == 0  # the float weight is dropped


# Measured over TEXTS' prompts, 24 tokens each: fp8 0.942, int8 0.933 (the lm_head unquantized).
GPU_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def scorer(default_model) -> LLM:
    return LLM(path=default_model, dtype="bfloat16")


@pytest.mark.parametrize("path", PATHS)
def test_default_model_through_the_gpu_linears_agrees_with_bfloat16(default_model, scorer, path):
    """The engine with every decoder linear on ScaledLinear (as `--quantization int8` sets
    them on a GPU), batched, in chunks of 16 prompt tokens, in a pool that preempts: the
    bfloat16 model, fed the same tokens, would have picked most of them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    q8 = LLM(
        path=default_model, dtype="bfloat16", max_num_batched_tokens=16, num_kv_blocks=24,
        block_size=4, pack_weights=False,
    )  # fmt: skip
    model = q8.runner.model
    model.fused_decode = None  # the fused CPU step reads the float weights
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in linears:
        m.int8 = ScaledLinear(m.weight, path)
    outs = [o.token_ids for o in q8.generate(prompts, sp)]
    assert q8.scheduler.engine_stats().num_preempted_total > 0
    assert all(len(o) == 24 for o in outs)
    rate = _agreement(scorer, prompts, outs)
    print(f"{path}: agreement {rate:.3f}")
    assert rate >= GPU_AGREEMENT
