"""Batched multi-LoRA for a mixed batch (Punica's SGMV, S-LoRA): one call adds, to every row
of a batch, the low-rank delta of that row's own adapter.

The rows come in segments (contiguous runs of rows that share an adapter slot):

    seg_start [G+1]   segment g is rows seg_start[g]:seg_start[g+1]
    seg_slot  [G]     its slot in the stacked weights, -1 for none (its rows are untouched)

and the adapters of S slots are stacked, each padded with zeros to rank R:

    a [S, P*R, in]    A of each of P parts (a fused q/k/v projection has P = 3)
    b [S, out, R]     B, already times the adapter's scale; part p owns the outputs
                      bounds[p]:bounds[p+1]

so that, for a row r of a segment with slot s and an output o of part p,

    t[r]     = a[s] @ x[r]                                    (float32)
    y[r, o] += sum_j b[s, o, j] * t[r, p*R + j]               (float32, rounded once)

`lora_apply` dispatches on y's device: on the CPU the compiled op
(`subway_kernels/csrc/lora_cpu.cpp`, float32 and bfloat16) when the CPU kernels are built
(`cpu_ext.load()`); on CUDA the Triton kernels (`triton_lora`); `lora_apply_ref` (a loop over
the segments with torch.matmul in float32) wherever neither applies. All three take the
segments as CPU tensors (int32 or int64), which a caller can build once per step and pass
to each of a layer's projections.

Layouts: x and y need contiguous rows (row strides may differ: views of a wider tensor are
fine), A contiguous rows. B may be contiguous [S, out, R], or, what the C++ op reads 1.4 to
1.9x faster at decode (no transpose per call), the transpose of a contiguous [S, R, out]:
store `bt = B.transpose(1, 2).contiguous()` once at load and pass `bt.transpose(1, 2)`.
Both give the same bits. The C++ op's output for a row does not depend on the other rows
of the call (batch invariance), nor on the thread count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_CPP_DTYPES = (torch.float32, torch.bfloat16)
_cpu_op = None  # the compiled op, resolved at the first CPU call; False: not built
_triton_fn = None  # triton_lora.lora_apply, resolved at the first CUDA call; False: no Triton


def lora_apply_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: Sequence[int],
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """`lora_apply` in plain PyTorch: a loop over the segments, float32 matmuls."""
    if rows is not None:
        gathered(lora_apply_ref, y, x, a, b, bounds, seg_start, seg_slot, rows)
        return
    starts = seg_start.tolist()
    slots = seg_slot.tolist()
    rank = b.shape[2]
    parts = len(bounds) - 1
    for g, s in enumerate(slots):
        r0, r1 = starts[g], starts[g + 1]
        if s < 0 or r1 <= r0:
            continue
        t = torch.matmul(x[r0:r1].float(), a[s].float().T)  # [n, P*R]
        for p in range(parts):
            lo, hi = bounds[p], bounds[p + 1]
            if hi <= lo:
                continue
            delta = torch.matmul(t[:, p * rank : (p + 1) * rank], b[s, lo:hi].float().T)
            y[r0:r1, lo:hi] = (y[r0:r1, lo:hi].float() + delta).to(y.dtype)


def gathered(fn, y, x, a, b, bounds, seg_start, seg_slot, rows: torch.Tensor) -> None:
    """`fn` (a `lora_apply` without `rows`) on the rows `rows` names, gathered, then
    written back."""
    idx = rows.to(y.device)
    ys = y.index_select(0, idx)
    fn(ys, x.index_select(0, idx), a, b, bounds, seg_start, seg_slot)
    y.index_copy_(0, idx, ys)


def _resolve_cpu_op():
    global _cpu_op
    from subway.kernels import cpu_ext

    op = False
    if cpu_ext.load() is not None:
        try:
            op = torch.ops.subway_lora.lora_apply.default
        except (AttributeError, RuntimeError):  # an extension built without lora_cpu.cpp
            op = False
    _cpu_op = op
    return op


def _resolve_triton():
    global _triton_fn
    fn = False
    try:
        from subway.kernels import triton_lora

        fn = triton_lora.lora_apply
    except ImportError:  # no Triton: the reference serves
        fn = False
    _triton_fn = fn
    return fn


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: Sequence[int],
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Add each row's LoRA delta to y in place (see the module's docstring).

    y [rows, out] and x [rows, in] (same dtype; rows may be strided, each row contiguous);
    a [S, P*R, in] (rows contiguous) and b [S, out, R] (contiguous, or the transpose of a
    contiguous [S, R, out]: faster), of x's dtype; bounds: P+1 ints; seg_start [G+1],
    seg_slot [G]: int32 or int64 CPU tensors. Rows outside the segments, rows of slot -1
    and outputs outside bounds[0]:bounds[P] are left as they are. `rows` (int32 or int64,
    CPU, each row at most once): the segments index it instead of the rows themselves, so
    that the rows of each adapter are grouped without moving them (the C++ op reads and
    writes them in place; elsewhere they are gathered and written back).
    """
    if y.device.type == "cpu":
        op = _cpu_op if _cpu_op is not None else _resolve_cpu_op()
        if op and y.dtype in _CPP_DTYPES:
            op(y, x, a, b, bounds, seg_start, seg_slot, rows)
            return
    elif y.device.type == "cuda":
        fn = _triton_fn if _triton_fn is not None else _resolve_triton()
        if fn:
            if rows is None:
                fn(y, x, a, b, bounds, seg_start, seg_slot)
            else:
                gathered(fn, y, x, a, b, bounds, seg_start, seg_slot, rows)
            return
    lora_apply_ref(y, x, a, b, bounds, seg_start, seg_slot, rows)
