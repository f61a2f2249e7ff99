"""Every decoder layer of a decode step in one compiled call (`FusedDecode`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from subway.kernels.attention import AttentionMetadata
from subway.worker.layers import PackedLinear
from subway.worker.model import MLP, DecoderLayer, KVCache

if TYPE_CHECKING:
    from subway.worker.model import CausalLM


class FusedDecode:
    """Every layer of a decode step in one compiled call (`Kernels.decode_layers`,
    subway_kernels/csrc/decode_layers_cpu.cpp): the same kernels, in the same order, as
    `DecoderLayer.forward`, so the same bits, without a few milliseconds of Python a step
    (docs/BENCHMARKS.md). It applies on one rank (no all-reduce between the kernels),
    without Qwen3's q/k norms, Gemma's layers, soft-capped scores or sliding windows (it
    attends globally), where every layer's linears take the few-row kernel (steps of up to
    `small_linear_rows` rows), or under `--quantization int8` where they all take the AVX2,
    AVX-512 or AMX int8 matmul (steps of any size: those take any row count). It
    holds the weight tensors the few-row kernel reads (`PackedLinear.small_read`), so a
    later move into huge pages (`rehome`, which swaps `.data`) is seen."""

    INT8_PATHS = {"avx2": 1, "amx": 2, "avx512": 3}  # decode_layers_cpu.cpp's Int8Path

    def __init__(self, model: CausalLM, call: Callable, int8_path: int) -> None:
        arch, none = model.arch, model.embed_tokens.new_empty(0)
        self.call = call
        self.int8_path = int8_path
        self.max_rows = model.kernels.small_linear_rows if int8_path == 0 else 1 << 30
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []  # the int8 linears' channel scales
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)
            w = [m.int8.packed if int8_path else m.small_read() for m in linears]
            self.weights += [layer.input_layernorm.weight, w[0], w[1]]
            self.weights += [layer.post_attention_layernorm.weight, w[2], w[3]]
            self.biases += [none if m.bias is None else m.bias for m in linears]
            self.scales += [m.int8.scales for m in linears] if int8_path else []
        attn = model.layers[0].self_attn
        self.shape = (attn.qkv.num_heads, attn.qkv.num_kv_heads, arch.head_dim)
        self.eps, self.scale = arch.rms_norm_eps, attn.scale
        # The runner's caches are allocated once: their K and V lists are made on first use.
        self._caches: list[KVCache] | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    @classmethod
    def build(cls, model: CausalLM) -> FusedDecode | None:
        call = model.kernels.decode_layers
        layers = list(model.layers)
        if call is None or not layers or model.arch.qk_norm or model.windows:
            return None  # no QK-norm, no sliding windows (the compiled layers attend globally)
        if any(type(layer) is not DecoderLayer or type(layer.mlp) is not MLP for layer in layers):
            return None  # the compiled layers are Llama's (not Gemma's, nor a mixture of experts)
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if layers[0].self_attn.o_proj.tp.world_size != 1:
            return None
        paths = {None if m.int8 is None else m.int8.path for m in linears}
        if paths == {None}:
            return None if any(m.small is None for m in linears) else cls(model, call, 0)
        if len(paths) == 1 and (path := paths.pop()) in cls.INT8_PATHS:
            return cls(model, call, cls.INT8_PATHS[path])
        return None  # oneDNN's int8 (VNNI) is Python's call; or a mix

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_caches is not self._caches:
            self._caches = kv_caches
            self._k, self._v = [k for k, _ in kv_caches], [v for _, v in kv_caches]
        h, residual = self.call(
            h, positions, rope_cache, md.slot_mapping, md.block_tables, md.context_lens,
            self._k, self._v, self.weights, self.biases, self.scales, self.int8_path,
            *self.shape, self.eps, self.scale,
        )  # fmt: skip
        return h, residual
