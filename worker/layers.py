"""Tensor-parallel linear layers that load (and shard) full Hugging Face weights.

Column-parallel layers split their output rows across ranks; row-parallel ones
split their input columns and all-reduce their output. Each layer's `load`
takes a full checkpoint tensor and copies this rank's part into place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from subway.kernels.dispatch import Kernels
from subway.worker.parallel import TensorParallel

if TYPE_CHECKING:
    from subway.worker.lora import LoraLinear
from subway.worker.quant import Int8Linear
from subway.worker.quant_gpu import ScaledLinear


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """`weight [out, in]` in oneDNN's blocked layout for `linear`, or None where unsupported.

    On the CPU `F.linear` reorders the weight into that layout on every call; at decode
    batch sizes the reorder costs about as much as the matmul (`tools/bench_linear.py`: 30
    layers of SmolLM2 at batch 4, bfloat16, 16.9 ms plain against 10.0 ms packed), and the
    result is the same.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):
        return None


def widen_bf16(mode: str) -> bool:
    """Whether bfloat16 linears run on float32 copies of their weights (`--bf16-matmul`).

    Where oneDNN has no native bfloat16 (no AVX512-BF16 or AMX, as on AMD before Zen 4) it
    widens both operands inside every call, and a decode step of 48 rows runs 3.2x slower
    than with float32 weights (docs/bench/log/2026-12-vs-vllm-avx2.md, "On a CPU without native bfloat16",
    `profile_step --bf16-matmul`). float32 products of
    bfloat16 values are exact and both accumulate in float32, so the widened matmul differs
    from the native one only in the order of its sums; the output is rounded to bfloat16."""
    if mode == "auto":
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return mode == "float32"


EXACT_ROWS = 64  # a packed matmul of up to this many rows (decode batches) runs at its size
ROW_BUCKET = 32  # one of more rows runs padded to a multiple of this


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    small: Callable | None = None,
    small_rows: int = 1,
    wide: bool = False,
    small_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x [rows, in]` times the weight. Up to `small_rows` rows go to `small` when the layer
    has it (bfloat16 decode: up to 4 rows, 64 on AVX2, 32 where the CPU has AMX:
    `Kernels.small_linear`), reading `small_weight` (the weight in its layout). `wide`:
    `packed` holds the float32 copy of a bfloat16 weight (`widen_bf16`). A packed weight's
    matmul keeps a compiled kernel per row count, never freed (about 0.6 MB for each;
    measured in docs/RELIABILITY.md), so row counts above `EXACT_ROWS` are padded to a
    multiple of `ROW_BUCKET`: a bounded set of kernels, where every prefill size would
    otherwise add one."""
    rows = x.shape[0]
    if small is not None and rows <= small_rows and x.is_contiguous():
        return small(x, small_read(weight, small_weight), bias)
    if packed is None:
        return F.linear(x, weight, bias)
    dtype = x.dtype
    if wide:
        x = x.float()
        bias = None if bias is None else bias.float()
    if rows <= EXACT_ROWS or rows % ROW_BUCKET == 0:
        y = packed_matmul(x, packed, bias)
    else:
        x = F.pad(x, (0, 0, 0, ROW_BUCKET - rows % ROW_BUCKET))
        y = packed_matmul(x, packed, bias)[:rows]
    return y.to(dtype) if wide else y


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Base of the linear layers: `weight`, `bias`, and an optional packed copy (`pack`)
    or int8 copy (`quantize`)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: torch.Tensor | None = None
    small: Callable | None = None  # its few-row linear (see `linear`), set by `pack`
    small_rows: int = 1
    # The weight as `small` reads it where that is not `weight` itself (AVX2: a copy in the
    # kernel's own layout, `Kernels.small_linear_pack`); a plain tensor, not a Parameter (so
    # not in the state dict). A move into huge pages (`rehome`) swaps its `.data`.
    small_weight: torch.Tensor | None = None
    wide: bool = False  # `packed` is a float32 copy of the bfloat16 weight
    # Set by `quantize`, the float weight then dropped: our int8 kernels on the CPU, torch's
    # 8-bit ops on a GPU.
    int8: Int8Linear | ScaledLinear | None = None
    in_features: int = 0  # this rank's input columns and output rows (the weight's shape)
    out_features: int = 0
    # LoRA (`worker/lora.py`): this layer's adapter slots, whose deltas `with_lora` adds.
    lora: LoraLinear | None = None

    def with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` (this layer's output for `x`, before any all-reduce) plus the step's LoRA
        deltas, where the step has any."""
        lora = self.lora
        if lora is not None and lora.step.active:
            lora(y, x)
        return y

    def small_read(self) -> torch.Tensor:
        """The tensor that `small` reads (`small_read`)."""
        return small_read(self.weight, self.small_weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times this layer's weight, plus `bias` when given: int8, packed or plain."""
        if self.int8 is not None:
            return self.int8(x, bias)
        return linear(
            x, self.weight, bias, self.packed, self.small, self.small_rows, self.wide,
            self.small_weight,
        )  # fmt: skip

    def quantize(self, ops: object | None) -> None:
        """Replace the weight by its 8-bit copy, freeing the float one: int8 on `ops`, the
        CPU's kernels (worker/quant.py), or with None (a GPU) fp8 or int8 on torch's ops
        (worker/quant_gpu.py)."""
        w = self.weight
        self.int8 = Int8Linear(w, ops) if ops is not None else ScaledLinear(w)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.unpack()

    def unpack(self) -> None:
        self.packed, self.small, self.small_weight, self.wide = None, None, None, False

    def pack(
        self,
        batch_hint: int,
        small: Callable | None = None,
        small_rows: int = 1,
        wide: bool = False,
        small_pack: Callable | None = None,
    ) -> bool:
        """Keep a packed copy of the loaded weight for `forward`; False where unsupported.
        `small` (`Kernels.small_linear`) serves steps of up to `small_rows` rows where the
        weight suits it: bfloat16, its input a multiple of 32; it reads the weight as
        `small_pack` (`Kernels.small_linear_pack`) lays it out. `wide`: a bfloat16 weight's
        packed copy is float32 (`widen_bf16`); the bfloat16 one stays. A quantized layer has
        nothing to pack."""
        if self.int8 is not None:
            return True
        w = self.weight
        self.wide = wide and w.dtype == torch.bfloat16
        self.packed = pack_weight(w.float() if self.wide else w, batch_hint)
        suits = w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0 and w.is_contiguous()
        self.small = small if suits and self.packed is not None else None
        self.small_rows = small_rows
        self.small_weight = small_layout(w, small_pack) if self.small is not None else None
        if self.packed is None:
            self.wide = False
        return self.packed is not None


def small_read(weight: torch.Tensor, small_weight: torch.Tensor | None) -> torch.Tensor:
    """The tensor the few-row linear reads: the weight in its own layout where it has one
    (`small_layout`), else the weight itself."""
    return weight if small_weight is None else small_weight


def small_layout(w: torch.Tensor, small_pack: Callable | None) -> torch.Tensor | None:
    """`w` repacked as the few-row linear reads it (AVX2: blocks of 16 outputs, gemv_cpu.cpp);
    None where it reads `w` as it is."""
    laid = None if small_pack is None else small_pack(w.detach())
    return None if laid is None or laid.data_ptr() == w.data_ptr() else laid


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy(param: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"{what}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(tensor)


class QKVParallelLinear(PackedLinear):
    """q, k and v projections in one matmul; this rank's query heads and KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = tp.heads(
            num_heads, num_kv_heads
        )
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.in_features, self.out_features = hidden_size, out
        self.weight = empty_param((out, hidden_size), dtype, device)
        self.bias = empty_param((out,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.with_lora(self.matmul(x, self.bias), x)
        return y.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def load(self, which: str, name: str, tensor: torch.Tensor) -> None:
        """`which` is q, k or v; `name` is weight or bias."""
        d = self.head_dim
        if which == "q":
            part = tensor[self.q_start * d : (self.q_start + self.num_heads) * d]
            dst = slice(0, self.q_size)
        else:
            part = tensor[self.kv_start * d : (self.kv_start + self.num_kv_heads) * d]
            first = self.q_size if which == "k" else self.q_size + self.kv_size
            dst = slice(first, first + self.kv_size)
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"{which}_proj.{name}: the model has no such parameter")
        _copy(param[dst], part, f"{which}_proj.{name}")


class MergedColumnParallelLinear(PackedLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local = [tp.shard(n, "intermediate_size") for n in out_features]
        self.in_features, self.out_features = in_features, sum(self.local)
        self.weight = empty_param((sum(self.local), in_features), dtype, device)
        self.bias = empty_param((sum(self.local),), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(self.matmul(x, self.bias), x)

    def load(self, index: int, name: str, tensor: torch.Tensor) -> None:
        n = self.local[index]
        first = sum(self.local[:index])
        part = tensor[self.tp.rank * n : (self.tp.rank + 1) * n]
        _copy(getattr(self, name)[first : first + n], part, f"merged[{index}].{name}")


class RowParallelLinear(PackedLinear):
    """Input columns split across ranks; partial outputs summed by an all-reduce, then the bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        in_shard: tuple[int, int] | None = None,
    ) -> None:
        """`in_shard`: (first column, columns) of the input this rank holds; default an even split."""
        super().__init__()
        self.tp = tp
        if in_shard is None:
            n = tp.shard(in_features, "row-parallel input")
            in_shard = (tp.rank * n, n)
        self.in_shard = in_shard
        self.in_features, self.out_features = in_shard[1], out_features
        self.weight = empty_param((out_features, self.in_shard[1]), dtype, device)
        self.bias = empty_param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.with_lora(self.matmul(x, self.bias), x)
        y = self.tp.all_reduce(self.with_lora(self.matmul(x, None), x))
        return y if self.bias is None else y + self.bias

    def load(self, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            _copy(self.bias, tensor, "row-parallel bias")
        else:
            first, n = self.in_shard
            _copy(self.weight, tensor[:, first : first + n], "row-parallel weight")


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, kernels: Kernels, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self._rms_norm = kernels.rms_norm
        self.eps = eps
        self.weight = empty_param((size,), dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, self.weight, self.eps, residual)
