"""The batched multi-LoRA kernel (`subway.kernels.lora`): the C++ op (lora_cpu.cpp) on its
AVX-512 build and, compiled again with -mno-avx512f, its AVX2 build, and the Triton kernels
under Triton's interpreter, all against `lora_apply_ref`; and the C++ op's batch invariance
(a row's output bits do not depend on the rows around it).

Inputs: segments that start past row 0 and end before the last row, slots repeated and -1,
parts of unequal sizes, outputs outside the parts, `in` and R on and off the vector width.
Rows outside the segments and outputs outside the parts must keep their bits.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from subway.kernels import cpu_ext
from subway.kernels.lora import lora_apply, lora_apply_ref

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),  # float32 sums in another order
    # each output rounded once to bfloat16 from float32 sums in another order: 1 ulp apart
    # at most where the sums straddle a rounding boundary (bfloat16's ulp: 2^-8 relative)
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def make_case(rows, in_f, sizes, rank, slots, dtype, seed):
    """(y, x, a, b, bounds): parts of `sizes` from output 2 on, 3 outputs past them."""
    gen = torch.Generator().manual_seed(seed)
    bounds = [2]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    out_f = bounds[-1] + 3
    parts = len(sizes)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    y = torch.randn(rows, out_f, generator=gen).to(dtype)
    a = (torch.randn(slots, parts * rank, in_f, generator=gen) * in_f**-0.5).to(dtype)
    b = (torch.randn(slots, out_f, rank, generator=gen) * rank**-0.5).to(dtype)
    return y, x, a, b, bounds


def make_segments(rows, seed, index_dtype=torch.int32):
    """Segments from row 1 (rows >= 3) to rows - 1 (rows >= 4), slots mixing -1 and repeats."""
    first = 1 if rows >= 3 else 0
    last = rows - 1 if rows >= 4 else rows
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(max(0, last - first - 1), generator=gen)[:5] + first + 1
    starts = sorted({first, last, *inner.tolist()})
    pattern = [2, -1, 0, 2, 3, 1, -1, 3]
    slots = [pattern[(g + seed) % len(pattern)] for g in range(len(starts) - 1)]
    return torch.tensor(starts, dtype=index_dtype), torch.tensor(slots, dtype=index_dtype)


def check_untouched(got, before, bounds, seg_start, seg_slot):
    """Rows outside active segments and outputs outside the parts keep their bits."""
    active = torch.zeros(got.shape[0], dtype=torch.bool)
    starts = seg_start.tolist()
    for g, s in enumerate(seg_slot.tolist()):
        if s >= 0:
            active[starts[g] : starts[g + 1]] = True
    assert torch.equal(got[~active], before[~active])
    assert torch.equal(got[:, : bounds[0]], before[:, : bounds[0]])
    assert torch.equal(got[:, bounds[-1] :], before[:, bounds[-1] :])


# ------------------------------------------------------------------------ the C++ op


@pytest.fixture(scope="module")
def op():
    """The compiled op (loaded here, not at import: the AVX2 check's process imports this
    module's helpers and registers an op of the same name from its own build)."""
    if cpu_ext.load() is None or not hasattr(torch.ops.subway_lora, "lora_apply"):
        pytest.skip("no C++ compiler: the reference is used")
    return torch.ops.subway_lora.lora_apply


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("sizes", [[64], [64, 16], [64, 16, 16]], ids=["P1", "P2", "P3"])
@pytest.mark.parametrize("rank,in_f", [(8, 72), (16, 576), (64, 136)])
def test_cpp_matches_reference(op, dtype, rows, sizes, rank, in_f):
    seed = rows * 7 + rank + len(sizes)
    y, x, a, b, bounds = make_case(rows, in_f, sizes, rank, 4, dtype, seed)
    seg_start, seg_slot = make_segments(rows, seed, torch.int32 if rows % 2 else torch.int64)
    got, want = y.clone(), y.clone()
    op(got, x, a, b, bounds, seg_start, seg_slot)
    lora_apply_ref(want, x, a, b, bounds, seg_start, seg_slot)
    torch.testing.assert_close(got, want, **TOL[dtype])
    check_untouched(got, y, bounds, seg_start, seg_slot)
    if (seg_slot >= 0).any():  # the delta reached y
        assert not torch.equal(got, y)
    again = y.clone()  # lora_apply dispatches to the op: the same bits
    lora_apply(again, x, a, b, bounds, seg_start, seg_slot)
    assert torch.equal(again, got)
    # B as the transpose of [S, R, out] (read as it is), A with padded rows: the same bits
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
    a_pad = torch.zeros(a.shape[0], a.shape[1], a.shape[2] + 5, dtype=dtype)[:, :, : a.shape[2]]
    a_pad.copy_(a)
    other = y.clone()
    op(other, x, a_pad, b_t, bounds, seg_start, seg_slot)
    assert torch.equal(other, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_batch_invariant(op, dtype):
    """Each row's output bits: alone, in a segment of 1 or 30 rows, in a batch of 64, with
    one thread or two."""
    rows = 64
    y, x, a, b, bounds = make_case(rows, 576, [64, 16, 16], 16, 4, dtype, seed=5)
    seg_start = torch.tensor([0, 30, 31, 45, 64], dtype=torch.int32)
    seg_slot = torch.tensor([1, 2, 1, 3], dtype=torch.int32)
    full = y.clone()
    lora_apply(full, x, a, b, bounds, seg_start, seg_slot)
    slot_of = torch.repeat_interleave(seg_slot, seg_start.diff())
    for r in range(rows):
        alone = y[r : r + 1].clone()
        lora_apply(alone, x[r : r + 1], a, b, bounds, torch.tensor([0, 1]), slot_of[r : r + 1])
        assert torch.equal(alone[0], full[r]), f"row {r}"
    # the 30-row segment as 30 one-row segments of the same slot; and rows as a strided view
    single = y.clone()
    lora_apply(single, x, a, b, bounds, torch.arange(31), torch.full((30,), 1))
    assert torch.equal(single[:30], full[:30])
    wide = torch.zeros(rows, 2 * y.shape[1], dtype=dtype)
    view = wide[:, 1 : 1 + y.shape[1]]
    view.copy_(y)
    lora_apply(view, x, a, b, bounds, seg_start, seg_slot)
    assert torch.equal(view, full)
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)  # B's other layout, row 40 alone
    alone = y[40:41].clone()
    lora_apply(alone, x[40:41], a, b_t, bounds, torch.tensor([0, 1]), slot_of[40:41])
    assert torch.equal(alone[0], full[40])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = y.clone()
        lora_apply(one, x, a, b, bounds, seg_start, seg_slot)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_rows_index_groups_rows_in_place(op, dtype):
    """`rows`: the segments index a list of rows (each adapter's grouped, the others left
    out), read and written in place: the same bits as each row computed in its own segment,
    rows not listed untouched; and the reference (which gathers) agrees."""
    n = 64
    y, x, a, b, bounds = make_case(n, 576, [64, 16, 16], 16, 4, dtype, seed=11)
    gen = torch.Generator().manual_seed(3)
    slot_of = torch.randint(-1, 4, (n,), generator=gen)  # -1: the base model's rows
    order = torch.sort(slot_of, stable=True).indices
    order = order[slot_of[order] >= 0]
    slots_sorted = slot_of[order]
    edges = (slots_sorted.diff() != 0).nonzero().flatten() + 1
    seg_start = torch.cat([torch.tensor([0]), edges, torch.tensor([len(order)])])
    seg_slot = slots_sorted[torch.cat([torch.tensor([0]), edges])]
    got = y.clone()
    lora_apply(got, x, a, b, bounds, seg_start, seg_slot, order)
    one_each = y.clone()  # every row its own one-row segment, in place
    lora_apply(one_each, x, a, b, bounds, torch.arange(n + 1), slot_of)
    assert torch.equal(got, one_each)
    assert torch.equal(got[slot_of < 0], y[slot_of < 0])
    want = y.clone()
    lora_apply_ref(want, x, a, b, bounds, seg_start, seg_slot, order)
    torch.testing.assert_close(got, want, **TOL[dtype])
    with pytest.raises(RuntimeError, match="at most once"):
        op(y.clone(), x, a, b, bounds, torch.tensor([0, 2]), torch.tensor([0]),
           torch.tensor([5, 5]))  # fmt: skip
    with pytest.raises(RuntimeError, match="at most once"):
        op(y.clone(), x, a, b, bounds, torch.tensor([0, 1]), torch.tensor([0]),
           torch.tensor([n]))  # fmt: skip


def test_cpp_rejects_bad_inputs(op):
    y, x, a, b, bounds = make_case(4, 32, [16], 8, 2, torch.float32, seed=1)
    start = torch.tensor([0, 4])
    with pytest.raises(RuntimeError, match="slot"):
        op(y, x, a, b, bounds, start, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="within the rows"):
        op(y, x, a, b, bounds, torch.tensor([0, 5]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="one dtype"):
        op(y, x.bfloat16(), a, b, bounds, start, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="parts"):
        op(y, x, a, b, [0, 8, 16], start, torch.tensor([0]))


def test_reference_serves_other_dtypes():
    """float16 on the CPU (no C++ path): lora_apply is the reference."""
    y, x, a, b, bounds = make_case(6, 40, [16, 8], 8, 4, torch.float16, seed=2)
    seg_start, seg_slot = make_segments(6, 2)
    got, want = y.clone(), y.clone()
    lora_apply(got, x, a, b, bounds, seg_start, seg_slot)
    lora_apply_ref(want, x, a, b, bounds, seg_start, seg_slot)
    assert torch.equal(got, want)
    ref64 = y.double()
    for g, s in enumerate(seg_slot.tolist()):
        r0, r1 = seg_start[g].item(), seg_start[g + 1].item()
        if s < 0:
            continue
        t = x[r0:r1].double() @ a[s].double().T
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            ref64[r0:r1, lo:hi] += t[:, p * 8 : (p + 1) * 8] @ b[s, lo:hi].double().T
    torch.testing.assert_close(want.double(), ref64, **TOL[torch.float16])


AVX2_CHECK = """
import fcntl, os, sys
import torch
from torch.utils import cpp_extension
from subway.kernels import cpu_ext

sys.path.insert(0, sys.argv[2])
from test_lora_kernels import TOL, make_case, make_segments, check_untouched
from subway.kernels.lora import lora_apply_ref

build = sys.argv[1]
os.makedirs(build, exist_ok=True)
with open(os.path.join(build, "subway.flock"), "w") as guard:
    fcntl.flock(guard, fcntl.LOCK_EX)
    try:
        os.unlink(os.path.join(build, "lock"))  # torch's, from a killed build
    except FileNotFoundError:
        pass
    cpp_extension.load(
        name="subway_lora_avx2", sources=[os.path.join(cpu_ext.CSRC, "lora_cpu.cpp")],
        extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"], build_directory=build, is_python_module=False)
assert torch.ops.subway_lora.lora_isa() == "avx2", torch.ops.subway_lora.lora_isa()
op = torch.ops.subway_lora.lora_apply
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 3, 16, 64, 200):
        for sizes in ([64], [64, 16, 16]):
            for rank, in_f in ((8, 72), (16, 576), (64, 136)):
                seed = rows + rank
                y, x, a, b, bounds = make_case(rows, in_f, sizes, rank, 4, dtype, seed)
                seg_start, seg_slot = make_segments(rows, seed)
                got, want = y.clone(), y.clone()
                op(got, x, a, b, bounds, seg_start, seg_slot)
                lora_apply_ref(want, x, a, b, bounds, seg_start, seg_slot)
                torch.testing.assert_close(got, want, **TOL[dtype])
                check_untouched(got, y, bounds, seg_start, seg_slot)
                other = y.clone()
                op(other, x, a, b.transpose(1, 2).contiguous().transpose(1, 2), bounds,
                   seg_start, seg_slot)
                assert torch.equal(other, got)
    # batch invariance on this build too
    y, x, a, b, bounds = make_case(64, 576, [64, 16, 16], 16, 4, dtype, seed=5)
    seg_start = torch.tensor([0, 30, 31, 64]); seg_slot = torch.tensor([1, 2, 1])
    full = y.clone()
    op(full, x, a, b, bounds, seg_start, seg_slot)
    slot_of = torch.repeat_interleave(seg_slot, seg_start.diff())
    for r in range(64):
        alone = y[r : r + 1].clone()
        op(alone, x[r : r + 1], a, b, bounds, torch.tensor([0, 1]), slot_of[r : r + 1])
        assert torch.equal(alone[0], full[r]), r
print("avx2 ok")
"""


def test_avx2_build_matches_reference():
    """The AVX2 path (machines without AVX-512) is compiled out here when the machine has
    AVX-512: build lora_cpu.cpp alone without it, in a process of its own (the op's name is
    the same), into a folder kept beside the kernels' (a rebuild only when the source
    changes: about 20 s on 2 cores), and check it as above."""
    with open("/proc/cpuinfo") as f:
        flags = f.read().replace("\n", " ")
    if not all(f" {x} " in flags for x in ("avx2", "fma")):
        pytest.skip("this CPU has no AVX2 and FMA")
    from subway.cache_dir import kernel_build_dir

    build = kernel_build_dir(cpu_ext.CSRC) + "-lora-avx2"
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK, build, here], capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and "avx2 ok" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------------ Triton

# Whether this process's Triton interprets: decided once, at import, by
# tests/test_kernels_triton.py (where nothing has imported Triton and there is no CUDA, it is
# imported interpreted; elsewhere these tests run in a child process).
from test_kernels_triton import INTERPRETED  # noqa: E402


@pytest.fixture(scope="module")
def triton_lora():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not INTERPRETED:
        pytest.skip("Triton is compiled in this process: test_triton_in_child_process runs these")
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("subway.kernels.triton_lora")
    if not isinstance(mod._shrink_kernel, InterpretedFunction):
        mod = importlib.reload(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16: no
@pytest.mark.parametrize(
    "rows,in_f,sizes,rank,starts,slots",
    [
        (20, 72, [32, 16, 8], 8, [1, 2, 7, 19], [1, -1, 1]),  # a segment past BLOCK_M
        (5, 64, [40], 16, [0, 5], [0]),
        (3, 24, [16, 16], 16, [0, 1, 2, 3], [2, 2, -1]),
        (40, 48, [16] * 5, 4, [3, 20, 38], [0, 1]),  # 5 parts: two expand launches
    ],
)
def test_triton_matches_reference(triton_lora, dtype, rows, in_f, sizes, rank, starts, slots):
    y, x, a, b, bounds = make_case(rows, in_f, sizes, rank, 3, dtype, seed=rows)
    seg_start = torch.tensor(starts, dtype=torch.int32)
    seg_slot = torch.tensor(slots, dtype=torch.int64)
    got, want = y.clone(), y.clone()
    triton_lora.lora_apply(got, x, a, b, bounds, seg_start, seg_slot)
    lora_apply_ref(want, x, a, b, bounds, seg_start, seg_slot)
    torch.testing.assert_close(got, want, **TOL[dtype])
    check_untouched(got, y, bounds, seg_start, seg_slot)
    other = y.clone()  # B as the transpose of [S, R, out]
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
    triton_lora.lora_apply(other, x, a, b_t, bounds, seg_start, seg_slot)
    torch.testing.assert_close(other, want, **TOL[dtype])


def _triton_in_child_process():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "triton",
         __file__],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and re.search(r"(\d+) skipped", summary) is None, summary


if not INTERPRETED and importlib.util.find_spec("triton") is not None:
    test_triton_in_child_process = _triton_in_child_process


def test_bench_prints_a_row_per_case(op, capsys):
    """tools/bench/bench_lora_kernel.py, one short round."""
    from subway.tools.bench import bench_lora_kernel

    bench_lora_kernel.main(
        ["--rounds", "1", "--calls", "2", "--rows", "1,3", "--dtypes", "float32", "--slots", "2"]
    )
    out = capsys.readouterr().out
    assert out.count("| float32 |") == 2 and "loop / C++ bT" in out
