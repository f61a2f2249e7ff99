"""Gemma 3's text model (`Gemma3ForCausalLM`, or that of a `Gemma3ForConditionalGeneration`
checkpoint, `checkpoint_name`) and Gemma 2 (`Gemma2ForCausalLM`) on the Llama family's
parts (`model.py`).

What differs from Llama, as transformers' `Gemma3ForCausalLM` computes it:
- the embeddings are scaled by sqrt(hidden_size) (in the model's dtype);
- every RMSNorm multiplies by (1 + weight): the checkpoint's weight + 1 is loaded
  (added in float32), so the same norm kernel runs;
- four norms a layer ("sandwich"): the attention's output and the MLP's output are
  normed before each joins the residual stream (post_attention_layernorm,
  post_feedforward_layernorm), besides the norms before each (input_layernorm,
  pre_feedforward_layernorm); q and k are normed per head (QK-norm), before rope;
- GeGLU (gelu, tanh approximation) in the MLP; the attention's scale is
  query_pre_attn_scalar ** -0.5;
- layers are sliding ("sliding_attention": a window of `sliding_window` tokens, rope
  base `rope_local_theta`) or global ("full_attention": `rope_theta`, and its scaling).

Gemma 2 (`Gemma2CausalLM`) is the same but for: no QK-norm (`arch.qk_norm` is False); one
rope (base and scaling) for both kinds of layer, every other one sliding; and
soft-capping, cap * tanh(x / cap), of every attention's scores (`attn_logit_softcapping`:
`Attention.cap_scores`, subway_kernels/attention.py) and of the final logits
(`final_logit_softcapping`: `compute_logits`). The Triton kernels cannot cap scores: such
a model is refused under them (families.py `check_kernels`).

A sliding layer's attention sees the last `sliding_window` keys (`model.layer_windows`,
`Attention.slide`; subway_kernels/attention.py) on the CPU path. Under the Triton kernels
(CUDA), which have no windows yet, the runner keeps every sequence inside the window
(`max_model_len` at most `sliding_window`), where a sliding layer's attention is a global
one, so the output is exact there too, and longer contexts are refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from subway.kernels.attention import AttentionMetadata
from subway.kernels.ops import rope_cos_sin_cache, rope_inv_freq
from subway.worker.layers import RMSNorm
from subway.worker.model import CausalLM, DecoderLayer, KVCache, ModelArch

SLIDING = "sliding_attention"
LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))  # fmt: skip
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                   "multi_modal_projector.")  # fmt: skip
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")  # fmt: skip


class GemmaDecoderLayer(DecoderLayer):
    """The Llama layer's attention, MLP and two norms, and the two norms around the MLP."""

    def __init__(self, arch: ModelArch, sliding: bool, tp, kernels, dtype, device) -> None:
        super().__init__(arch, tp, kernels, dtype, device)
        norm = (arch.hidden_size, arch.rms_norm_eps, kernels, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(*norm)
        self.post_feedforward_layernorm = RMSNorm(*norm)
        self.sliding = sliding
        # A sliding layer's rope cache (the model's; None: the global one, as Gemma 2's).
        self.rope_local: torch.Tensor | None = None

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
        rope = self.rope_local if self.sliding and self.rope_local is not None else rope_cache
        h = self.post_attention_layernorm(self.self_attn(h, positions, rope, md, kv_cache))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaCausalLM(CausalLM):
    """What Gemma 2 and Gemma 3 share: their layers, scaled embeddings, (1 + weight) norms."""

    def __init__(self, arch: ModelArch, tp, dtype, device, max_positions: int, kernels) -> None:
        super().__init__(arch, tp, dtype, device, max_positions, kernels)
        self.embed_scale = torch.tensor(arch.hidden_size**0.5, dtype=dtype)

    def make_layer(self, arch: ModelArch, i: int, *args) -> nn.Module:
        return GemmaDecoderLayer(arch, arch.layer_types[i] == SLIDING, *args)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        for i in range(self.arch.num_layers):
            names |= {f"model.layers.{i}.{n}.weight" for n in NORMS[2:]}
        return names

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name.endswith("norm.weight"):  # (1 + weight), in float32 as transformers has it
            tensor = tensor.float() + 1.0
        m = name.split(".")
        if len(m) == 5 and m[0] == "model" and m[1] == "layers" and m[3] in NORMS[2:]:
            getattr(self.layers[int(m[2])], m[3]).weight.copy_(tensor.to(self.embed_tokens.dtype))
            return True
        return super().load_weight(name, tensor)


class Gemma3CausalLM(GemmaCausalLM):
    def __init__(self, arch: ModelArch, tp, dtype, device, max_positions: int, kernels) -> None:
        super().__init__(arch, tp, dtype, device, max_positions, kernels)
        local = rope_inv_freq(arch.head_dim, arch.rope_local_theta or 10000.0, None)
        self.register_buffer(
            "rope_cache_local",
            rope_cos_sin_cache(local, max_positions, dtype, device),
            persistent=False,
        )
        for layer in self.layers:
            layer.rope_local = self.rope_cache_local

    def checkpoint_name(self, key: str) -> str | None:
        """A vision-language checkpoint's text model under its own names (transformers 5:
        `model.language_model.*`; earlier: `language_model.model.*`); its vision tower and
        projector are not run."""
        for prefix, to in LANGUAGE_PREFIXES:
            if key.startswith(prefix):
                return to + key[len(prefix) :]
        if key.startswith(VISION_PREFIXES):
            return None
        return key


class Gemma2CausalLM(GemmaCausalLM):
    """Gemma 2: the shared layers (the global rope for both kinds), scores and logits
    soft-capped (module doc)."""

    def __init__(self, arch: ModelArch, tp, dtype, device, max_positions: int, kernels) -> None:
        super().__init__(arch, tp, dtype, device, max_positions, kernels)
        if arch.attn_softcap:
            for layer in self.layers:
                layer.self_attn.cap_scores(arch.attn_softcap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits capped, cap * tanh(logits / cap), in the logits' dtype (each step
        rounded to it), as transformers' `Gemma2ForCausalLM` computes them."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_softcap
        if not cap:
            return logits
        capped = logits / cap
        return capped.tanh_().mul_(cap)
