"""The AVX-512 VNNI int8 matmul (subway_kernels/csrc/avx512_int8_cpu.cpp): the exact int32
sums (u = x + 128 against the signed weight, minus 128 * sum w per output), scaled and
rounded as the AVX2 and AMX kernels do, so the same bits as theirs."""

from __future__ import annotations

import pytest
import torch

from subway.worker import quant
from subway.worker.quant import Int8Linear, int8_ops, quantize_weight

DTYPES = (torch.float32, torch.bfloat16)
ROWS = (1, 2, 3, 5, 16, 64, 300)


@pytest.fixture(scope="module")
def ops():
    return int8_ops()


@pytest.fixture(scope="module")
def avx512(ops):
    if not ops.avx512_int8_supported():
        pytest.skip("no AVX-512 VNNI int8 kernel: the build or the CPU lacks AVX-512 F/BW/VL/VNNI")
    return ops


def _once_rounded(qx, sx, qw, sw, b, dtype) -> torch.Tensor:
    """The exact int64 sums, float32(sum) * w_scale rounded, then * x_scale + bias in one
    rounding (float64 then float32, as the fma: exact products), then to `dtype`."""
    sums = (qx.long() @ qw.long().T).float()
    t = (sums * sw[None, :]).double()
    bias = 0.0 if b is None else b.float().double()[None, :]
    return (t * sx.double()[:, None] + bias).float().to(dtype)


def _raw_sums(ops, qx, packed, n) -> torch.Tensor:
    """The kernel's int32 sums themselves: unit scales, float32 out (exact below 2^24)."""
    ones = torch.ones(qx.shape[0])
    return ops.avx512_int8_matmul(qx, ones, packed, torch.ones(n), None, torch.float32)


@pytest.mark.parametrize("k", [64, 576, 1536])
def test_same_bits_as_the_avx2_kernel(avx512, k):
    """Rows 1 to 300 (every tile shape, a partial last row block), N = 605 (a partial last
    strip), both dtypes, with and without a bias: the AVX2 kernel's bits, and the exact
    reference's."""
    if not avx512.avx2_int8_supported():
        pytest.skip("no AVX2 int8 kernel in this build to compare with")
    torch.manual_seed(k)
    n = 605
    qw, sw = quantize_weight(torch.randn(n, k) * 0.05)
    p512, p2 = avx512.avx512_int8_pack(qw), avx512.avx2_int8_pack(qw)
    for rows in ROWS:
        x = torch.randn(rows, k)
        for dtype in DTYPES:
            qx, sx = avx512.quantize_rows(x.to(dtype))
            for b in (None, torch.randn(n).to(dtype)):
                y = avx512.avx512_int8_matmul(qx, sx, p512, sw, b, dtype)
                assert y.dtype == dtype and y.shape == (rows, n)
                assert torch.equal(y, avx512.avx2_int8_matmul(qx, sx, p2, sw, b, dtype))
                assert torch.equal(y, _once_rounded(qx, sx, qw, sw, b, dtype))


@pytest.mark.parametrize("k", [64, 576, 1536, 4 * 37, 5, 103])
def test_sums_are_the_exact_integer_dot_products(avx512, k):
    """The int32 sums equal (xq.long() @ wq.long().T), at any in_features: odd multiples of
    4 (148) and others (5, 103: padded to 4 with zero weights)."""
    torch.manual_seed(k)
    n = 40
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = avx512.avx512_int8_pack(qw)
    for rows in ROWS:
        qx = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        exact = qx.long() @ qw.long().T
        assert exact.abs().max() < 2**24  # exact in float32
        assert torch.equal(_raw_sums(avx512, qx, packed, n).long(), exact)


def test_extreme_sums_are_exact(avx512):
    """Rows of +-127 against weights of +-127, every sign pattern: the largest sums (u up to
    255, where 16-bit pairs of products would saturate) are exact, and so is the
    compensation for an all -127 or all +127 weight."""
    k = 1536
    w = torch.full((32, k), 127, dtype=torch.int8)
    w[1] = -127
    w[2, ::2] = -127
    w[3, 1::2] = -127
    x = torch.full((4, k), 127, dtype=torch.int8)
    x[1] = -127
    x[2, ::2] = -127
    x[3, 1::2] = -127
    packed = avx512.avx512_int8_pack(w)
    exact = x.long() @ w.long().T
    assert exact.abs().max() == 127 * 127 * k
    sums = avx512.avx512_int8_matmul(x, torch.ones(4), packed, torch.ones(32), None, torch.float32)
    assert torch.equal(sums.double(), exact.double())  # 24.8M: float32 holds it exactly


def test_int8_linear_takes_it_by_default(avx512):
    """Without AMX, `choose_path` picks this kernel at any in_features, and Int8Linear's
    output is the exact arithmetic's."""
    torch.manual_seed(1)
    if not avx512.amx_int8_supported():
        assert quant.choose_path(avx512, 576) == "avx512"
        assert quant.choose_path(avx512, 101) == "avx512"
    w = torch.randn(100, 101).bfloat16()
    b = torch.randn(100).bfloat16()
    lin = Int8Linear(w, avx512, "avx512")
    assert lin.path == "avx512"
    x = torch.randn(7, 101).bfloat16()
    qx, sx = avx512.quantize_rows(x)
    qw, sw = quantize_weight(w)
    assert torch.equal(lin(x, b), _once_rounded(qx, sx, qw, sw, b, torch.bfloat16))


def test_refuses_what_it_cannot_take(ops):
    q, s = quantize_weight(torch.randn(64, 128))
    xq, xs = ops.quantize_rows(torch.randn(4, 128))
    packed = ops.avx512_int8_pack(q)
    with pytest.raises(RuntimeError, match="avx512_int8_pack"):
        ops.avx512_int8_pack(torch.zeros(8, 30, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="avx512_int8_pack"):
        ops.avx512_int8_pack(torch.zeros(8, 0, dtype=torch.int8))
    if not ops.avx512_int8_supported():  # a clear error, and Int8Linear never calls it
        with pytest.raises(RuntimeError, match="AVX-512"):
            ops.avx512_int8_matmul(xq, xs, packed, s, None, torch.float32)
        with pytest.raises(ValueError, match="cannot run here"):
            Int8Linear(torch.randn(64, 128), ops, "avx512")
        return
    ops.avx512_int8_matmul(xq, xs, packed, s, None, torch.float32)
    with pytest.raises(RuntimeError, match="avx512_int8_pack"):
        ops.avx512_int8_matmul(xq, xs, packed[:-1], s, None, torch.float32)  # a short weight
    with pytest.raises(RuntimeError, match="avx512_int8_pack"):  # packed for another shape
        ops.avx512_int8_matmul(xq[:, :125].contiguous(), xs, packed, s, None, torch.float32)
    with pytest.raises(RuntimeError, match="avx512_int8_pack"):  # N or K not as packed
        ops.avx512_int8_matmul(xq, xs, ops.avx512_int8_pack(q[:, :127].contiguous()), s, None,
                               torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match="aligned"):
        shifted = torch.zeros(packed.numel() + 1, dtype=torch.int8)[1:]
        shifted.copy_(packed)
        ops.avx512_int8_matmul(xq, xs, shifted, s, None, torch.float32)
    with pytest.raises(RuntimeError, match="one per row"):
        ops.avx512_int8_matmul(xq, xs[:-1], packed, s, None, torch.float32)
    with pytest.raises(RuntimeError, match="bias"):
        ops.avx512_int8_matmul(xq, xs, packed, s, torch.zeros(3), torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.avx512_int8_matmul(xq, xs, packed, s, None, torch.float16)
    with pytest.raises(RuntimeError, match="int8 x"):
        ops.avx512_int8_matmul(xq.float(), xs, packed, s, None, torch.float32)
