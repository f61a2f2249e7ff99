"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) over a flat mixed batch.

One forward takes every scheduled token of a step at once; attention reads and
writes the paged KV cache. Hidden states are normed and projected to logits
only at the positions that sample.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from subway.kernels.attention import AttentionMetadata
from subway.kernels.dispatch import Kernels
from subway.kernels.ops import rope_cos_sin_cache, rope_inv_freq
from subway.worker.layers import (
    MergedColumnParallelLinear,
    PackedLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    empty_param,
    linear,
    pack_weight,
    small_layout,
    small_read,
)
from subway.worker.model_arch import ModelArch
from subway.worker.parallel import TensorParallel
from subway.worker.quant import Int8Linear

if TYPE_CHECKING:
    from subway.worker.fused_decode import FusedDecode
    from subway.worker.lora import LoraStep

KVCache = tuple[torch.Tensor, torch.Tensor]


def layer_windows(arch: ModelArch, kernels: Kernels) -> list[int]:
    """Each layer's sliding window (0: global attention): the `sliding_attention` layers of
    `arch.layer_types` (model_arch.py `_window`: Gemma's, every layer of Mistral and
    Mixtral, a Qwen config's own). All 0 under the Triton kernels, which have no windows:
    there (and for a Qwen window without layer kinds) the runner keeps every sequence inside
    the window (`max_model_len`), where a sliding layer's attention is the global one."""
    w = arch.sliding_window or 0
    if not w or kernels.name == "triton" or not arch.layer_types:
        return [0] * arch.num_layers
    return [w if t == "sliding_attention" else 0 for t in arch.layer_types]


def max_model_len(arch: ModelArch, kernels: Kernels, limit: int) -> int:
    """The runner's `max_model_len`: `limit` (`--max-model-len`, else the model's positions),
    or the sliding window where the model has one that its layers do not run
    (`layer_windows`: under the Triton kernels on CUDA, which have no windows, and Qwen2/3's
    windows): every sequence stays inside the window, where a sliding layer's attention is
    the global one, so the output is exact and longer contexts are refused. On the CPU (the
    PyTorch references and the compiled decode kernels) the layers slide: no cap."""
    if not arch.sliding_window or any(layer_windows(arch, kernels)):
        return limit
    return min(limit, arch.sliding_window)


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel,
        kernels: Kernels,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self._rope_and_write_kv = kernels.rope_and_write_kv
        self._paged_attention = kernels.paged_attention
        self.head_dim = arch.head_dim
        self.scale = arch.attn_scale or arch.head_dim**-0.5
        self.qkv = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_heads,
            arch.num_kv_heads,
            arch.qkv_bias,
            tp,
            dtype,
            device,
        )
        q = self.qkv  # o_proj's input columns are this rank's query heads
        self.o_proj = RowParallelLinear(
            arch.num_heads * arch.head_dim,
            arch.hidden_size,
            arch.o_bias,
            tp,
            dtype,
            device,
            in_shard=(q.q_start * arch.head_dim, q.num_heads * arch.head_dim),
        )
        norm = (arch.head_dim, arch.rms_norm_eps, kernels, dtype, device)
        self.q_norm = RMSNorm(*norm) if arch.qk_norm else None
        self.k_norm = RMSNorm(*norm) if arch.qk_norm else None
        self.window = 0  # a sliding window of that many keys (`slide`); 0: global

    def slide(self, window: int) -> None:
        """Attend over the last `window` keys only (`paged_attention`'s `window`)."""
        self.window = window
        self._paged_attention = partial(self._paged_attention, window=window)

    def cap_scores(self, softcap: float) -> None:
        """Soft-cap the scores, softcap * tanh(score / softcap) (`paged_attention`'s
        `softcap`: Gemma 2's attn_logit_softcapping; not under the Triton kernels)."""
        self._paged_attention = partial(self._paged_attention, softcap=softcap)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = q.view(n, -1, self.head_dim)
        k = k.view(n, -1, self.head_dim)
        v = v.view(n, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        k_cache, v_cache = kv_cache
        q = self._rope_and_write_kv(
            q, k, v, positions, rope_cache, k_cache, v_cache, md.slot_mapping
        )
        out = self._paged_attention(q, k_cache, v_cache, md, self.scale)
        return self.o_proj(out.view(n, -1))


class MLP(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel,
        kernels: Kernels,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self._act_and_mul = kernels.silu_and_mul if arch.hidden_act == "silu" else gelu_tanh_and_mul
        i = arch.intermediate_size
        self.gate_up = MergedColumnParallelLinear(
            arch.hidden_size, [i, i], arch.mlp_bias, tp, dtype, device
        )
        self.down_proj = RowParallelLinear(i, arch.hidden_size, arch.mlp_bias, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act_and_mul(self.gate_up(x)))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): `gelu_tanh(x[..., :n]) * x[..., n:]` for a merged gate|up of width 2n."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel,
        kernels: Kernels,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, kernels, dtype, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, kernels, dtype, device)
        self.self_attn = Attention(arch, tp, kernels, dtype, device)
        self.mlp = MLP(arch, tp, kernels, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope_cache, md, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings and lm_head are replicated on every rank; only rank 0 computes logits.

    `kernels` (`dispatch.choose_kernels`) is chosen once, for the model's device; every
    layer keeps the functions it calls.
    """

    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.kernels = kernels
        self.embed_tokens = empty_param((arch.vocab_size, arch.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            self.make_layer(arch, i, tp, kernels, dtype, device) for i in range(arch.num_layers)
        )
        windows = layer_windows(arch, kernels)
        for layer, window in zip(self.layers, windows, strict=True):
            if window:
                layer.self_attn.slide(window)
        self.windows = tuple(sorted(set(windows) - {0}))  # build_metadata's `windows`
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if arch.tie_word_embeddings
            else empty_param((arch.vocab_size, arch.hidden_size), dtype, device)
        )
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.register_buffer(
            "rope_cache",
            rope_cos_sin_cache(inv_freq, max_positions, dtype, device),
            persistent=False,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def make_layer(self, arch: ModelArch, i: int, *args) -> nn.Module:
        """Layer `i` (`args`: tp, kernels, dtype, device); a family's subclass makes its own."""
        return DecoderLayer(arch, *args)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: list[KVCache],
        sample_idx: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states `[len(sample_idx), hidden]` at the sampling positions."""
        h = self.embed(input_ids)
        fused = self.fused_decode
        lora = self.lora_step
        if lora is not None and lora.active:
            fused = None  # the compiled layers know no adapters
        if fused is not None and md.all_decode and h.shape[0] <= fused.max_rows:
            h, residual = fused(h, positions, self.rope_cache, md, kv_caches)
        else:
            residual = None
            per = md.per_layer or [md] * len(kv_caches)  # hybrid KV groups: the layer's own
            for layer, kv, lmd in zip(self.layers, kv_caches, per, strict=True):
                h, residual = layer(h, residual, positions, self.rope_cache, lmd, kv)
        h, residual = h.index_select(0, sample_idx), residual.index_select(0, sample_idx)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(hidden)
        return linear(
            hidden, self.lm_head, None, self.lm_head_packed, self.lm_head_small,
            self.kernels.small_linear_rows, self.lm_head_wide, self.lm_head_small_weight,
        )  # fmt: skip

    lm_head_packed: torch.Tensor | None = None
    lm_head_wide: bool = False  # lm_head_packed is the float32 copy of a bfloat16 lm_head
    lm_head_small: Callable | None = None  # the few-row linear, for a decode step's logits
    lm_head_small_weight: torch.Tensor | None = None  # lm_head as lm_head_small reads it (AVX2)
    lm_head_int8: Int8Linear | None = None
    fused_decode: FusedDecode | None = None  # set by pack_weights where it applies
    lora_step: LoraStep | None = None  # with LoRA on: the step's adapter segments (lora.py)

    def quantize_int8(self, ops: object | None, lm_head: torch.Tensor | None = None) -> None:
        """`--quantization int8` (worker/quant.py), after loading (and smoothing,
        worker/smooth.py): every linear layer's weight, and `lm_head` (the smoothed copy
        of the lm_head's weight) when given; the embeddings stay as they are. `ops`: the
        CPU's int8 kernels (None on a GPU, worker/quant_gpu.py)."""
        for m in self.modules():
            if isinstance(m, PackedLinear):
                m.quantize(ops)
        if lm_head is not None:
            self.lm_head_int8 = Int8Linear(lm_head, ops)

    def pack_weights(
        self, batch_hint: int, one_row_lm_head: bool = False, wide: bool = False
    ) -> bool:
        """Packed copies of every linear weight and the lm_head, after loading (CPU only);
        `one_row_lm_head`: decode logits (up to `small_linear_rows` rows) through small_linear
        too (its weight in huge pages);
        `wide`: bfloat16 weights packed as float32 (`layers.widen_bf16`)."""
        from subway.worker.fused_decode import FusedDecode  # it imports this module

        small, rows = self.kernels.small_linear, self.kernels.small_linear_rows
        small_pack = self.kernels.small_linear_pack
        ok = all(
            m.pack(batch_hint, small, rows, wide, small_pack)
            for m in self.modules()
            if isinstance(m, PackedLinear)
        )
        if self.lm_head_int8 is not None:
            self.fused_decode = FusedDecode.build(self) if ok else None
            return ok
        w = self.lm_head
        self.lm_head_wide = wide and w.dtype == torch.bfloat16
        self.lm_head_packed = (
            pack_weight(w.float() if self.lm_head_wide else w, batch_hint) if ok else None
        )
        # Decode logits: small_linear too, once its weight is in huge pages (rehome): one
        # row 1.01 against oneDNN's 1.21 ms (docs/BENCHMARKS.md), 16 rows (AMX) 3.4 against
        # 4.3; slower in small pages.
        suits = w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0
        self.lm_head_small = (
            small if one_row_lm_head and suits and self.lm_head_packed is not None else None
        )
        # Where the kernel's layout is its own (AVX2) a copy: a tied lm_head is the embedding
        # table too, whose rows stay as they are.
        self.lm_head_small_weight = (
            small_layout(w, small_pack) if self.lm_head_small is not None else None
        )
        if not ok or self.lm_head_packed is None:
            for m in self.modules():
                if isinstance(m, PackedLinear):
                    m.unpack()
            self.lm_head_wide = False
            return False
        self.fused_decode = FusedDecode.build(self)
        return True

    def one_row_weights(self) -> list[torch.Tensor]:
        """The weights that the few-row linear reads (after `pack_weights`)."""
        out = [m.small_read() for m in self.modules() if isinstance(m, PackedLinear) and m.small]
        if self.lm_head_small is not None:
            out.append(small_read(self.lm_head, self.lm_head_small_weight))
        return out

    # ------------------------------------------------------------------ weights

    def checkpoint_name(self, key: str) -> str | None:
        """A checkpoint entry's name as `load_weight` knows it (None: not this model's)."""
        return key

    def expected_weights(self) -> set[str]:
        """Checkpoint names that must all be present."""
        arch = self.arch
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not arch.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            for proj in ("q", "k", "v", "o"):
                names.add(f"{p}self_attn.{proj}_proj.weight")
            for proj in ("gate", "up", "down"):
                names.add(f"{p}mlp.{proj}_proj.weight")
            if arch.qkv_bias:
                names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
            if arch.o_bias:
                names.add(f"{p}self_attn.o_proj.bias")
            if arch.mlp_bias:
                names |= {f"{p}mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
            if arch.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy this rank's part of checkpoint tensor `name`; False if the name is not a weight."""
        tensor = tensor.to(self.embed_tokens.dtype)
        if name == "model.embed_tokens.weight":
            self.embed_tokens.copy_(tensor)
            return True
        if name == "lm_head.weight":
            if not self.arch.tie_word_embeddings:
                self.lm_head.copy_(tensor)
            return True
        if name == "model.norm.weight":
            self.norm.weight.copy_(tensor)
            return True
        m = _LAYER.fullmatch(name)
        if m is None:
            return False
        layer = self.layers[int(m["i"])]
        module, part, kind = m["module"], m["part"], m["kind"]
        if module in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, module).weight.copy_(tensor)
        elif part in ("q_norm", "k_norm"):
            getattr(layer.self_attn, part).weight.copy_(tensor)
        elif part in ("q_proj", "k_proj", "v_proj"):
            layer.self_attn.qkv.load(part[0], kind, tensor)
        elif part == "o_proj":
            layer.self_attn.o_proj.load(kind, tensor)
        elif part in ("gate_proj", "up_proj"):
            layer.mlp.gate_up.load(0 if part == "gate_proj" else 1, kind, tensor)
        elif part == "down_proj":
            layer.mlp.down_proj.load(kind, tensor)
        else:
            return False
        return True


_LAYER = re.compile(
    r"model\.layers\.(?P<i>\d+)\.(?P<module>[a-z_]+)(?:\.(?P<part>[a-z_]+))?\.(?P<kind>weight|bias)"
)
