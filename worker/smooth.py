"""Smoothing before int8 (`--quantization int8`): activation outliers moved into the weights.

Per-token int8 activations lose the small channels of a row to its few large ones. As
SmoothQuant does, each linear layer's input channel j is divided by a factor s_j and
the weight's column j multiplied by it, which leaves the float product unchanged:
s_j = sqrt(max|x_j| / max|W_:,j|) (alpha 0.5), from the activations of one forward
pass over a fixed calibration text at load time. Each division is folded into what
produces the input, so nothing is added to a step:

- qkv and gate_up: into the RMSNorm weight before them;
- o_proj: into the value rows of qkv (attention is linear in V), one factor per KV
  channel, shared by the query heads of its group;
- down_proj: into the up rows of gate_up (silu(gate) * up is linear in up);
- the lm_head: into the final norm's weight, with a smoothed copy of the lm_head (the
  embeddings keep theirs).

Measured on the default model (docs/BENCHMARKS.md): perplexity +1.5% with the lm_head in
int8 too, against +3.4% without smoothing. Under tensor parallelism every rank runs the
calibration pass together (the same tokens) and smooths its own shards.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from subway.kernels.attention import build_metadata, positions_and_slots
from subway.worker.kv_cache import allocate_kv_cache

ALPHA = 0.5
CALIBRATION_TEXT = (
    "The committee met on a grey Tuesday morning to review the budget for the coming year. "
    "Most of the discussion was about the new library: whether to build it near the station, "
    "where rents are high, or on the old factory site by the river. In the end they voted to "
    "ask the residents.\n\nTo install the package, create a virtual environment, activate it, "
    "and run the install command; then check the version:\n\n    python -m venv .venv\n"
    "    . .venv/bin/activate\n    pip install example==2.1\n\ndef mean(values):\n"
    '    """The arithmetic mean of a non-empty list."""\n    return sum(values) / len(values)\n'
    "\nQ: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 "
    "degrees Fahrenheit. At higher altitudes it boils at a lower temperature, because the air "
    "pressure is lower. 1, 2, 3, 5, 8, 13, 21 — each number is the sum of the two before it."
)


@torch.no_grad()
def input_ranges(model: nn.Module, ids: list[int], block_size: int) -> dict[object, torch.Tensor]:
    """max |x_j| of every linear layer's input (and the lm_head's, key "lm_head") over one
    forward pass of `ids`, on a scratch KV cache."""
    from subway.worker.layers import PackedLinear
    from subway.worker.moe import Experts

    ranges: dict[object, torch.Tensor] = {}

    def keep(key: object, x: torch.Tensor) -> None:
        r = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        ranges[key] = torch.maximum(ranges[key], r) if key in ranges else r

    hooks = [
        m.register_forward_pre_hook(lambda mod, args: keep(mod, args[0]))
        for m in model.modules()
        if isinstance(m, (PackedLinear, Experts))  # a MoE layer's input too
    ]
    try:
        arch, device = model.arch, model.embed_tokens.device
        qkv = model.layers[0].self_attn.qkv
        n = len(ids)
        blocks = -(-n // block_size)
        caches = allocate_kv_cache(
            arch.num_layers, blocks, block_size, qkv.num_kv_heads, arch.head_dim,
            model.embed_tokens.dtype, device, huge_pages=False,
        )  # fmt: skip
        lens, table = np.array([n]), np.arange(blocks, dtype=np.int32)[None, :]
        positions, slots = positions_and_slots(lens, lens, table, block_size)
        md = build_metadata(lens, lens, table, slots, block_size, device, model.windows)
        hidden = model(
            torch.tensor(ids, device=device),
            torch.from_numpy(positions).to(device),
            md,
            caches,
            torch.arange(n, device=device),
        )
        keep("lm_head", hidden)
    finally:
        for h in hooks:
            h.remove()
    return ranges


def factors(x_range: torch.Tensor, w_range: torch.Tensor) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), kept within [1e-2, 1e2]."""
    s = x_range.clamp(min=1e-5) ** ALPHA / w_range.clamp(min=1e-5) ** (1 - ALPHA)
    return s.clamp(1e-2, 1e2)


def column_ranges(weight: torch.Tensor) -> torch.Tensor:
    """max |W_:,j| of `weight [out, in]`, per input channel j."""
    return weight.detach().float().abs().amax(0)


def _scale(t: torch.Tensor, by: torch.Tensor) -> None:
    """t *= by (broadcast), computed in float32 and rounded once to t's dtype."""
    t.copy_((t.float() * by).to(t.dtype))


@torch.no_grad()
def smooth(model: nn.Module, ranges: dict[object, torch.Tensor]) -> torch.Tensor:
    """Fold the factors into the model (see the module doc); the smoothed lm_head copy."""
    from subway.worker.moe import Experts

    for layer in model.layers:
        _smooth_attention(layer.self_attn, layer.input_layernorm, ranges)
        # The norm whose output the MLP reads (Gemma's sandwich: the pre-feedforward one).
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)
        mlp = layer.mlp
        if isinstance(mlp, Experts):
            _smooth_experts(mlp, mlp_norm, ranges)
        else:
            s = factors(ranges[mlp.gate_up], column_ranges(mlp.gate_up.weight))
            _scale(mlp.gate_up.weight, s[None, :])
            _scale(mlp_norm.weight, 1 / s)
            _smooth_down(mlp, ranges)
    s = factors(ranges["lm_head"], column_ranges(model.lm_head))
    _scale(model.norm.weight, 1 / s)
    return (model.lm_head.detach().float() * s[None, :]).to(model.lm_head.dtype)


def _smooth_attention(attn: nn.Module, norm: nn.Module, ranges: dict) -> None:
    qkv = attn.qkv
    s = factors(ranges[qkv], column_ranges(qkv.weight))
    _scale(qkv.weight, s[None, :])
    _scale(norm.weight, 1 / s)
    # o_proj's input channel (query head h, d) reads value channel (h // group, d).
    kv, d = qkv.num_kv_heads, qkv.head_dim
    group = qkv.num_heads // kv
    x = ranges[attn.o_proj].view(kv, group, d).amax(1)
    s = factors(x, column_ranges(attn.o_proj.weight).view(kv, group, d).amax(1))
    _scale(attn.o_proj.weight, s[:, None, :].expand(kv, group, d).reshape(1, -1))
    v = slice(qkv.q_size + qkv.kv_size, qkv.q_size + 2 * qkv.kv_size)
    _scale(qkv.weight[v], 1 / s.reshape(-1, 1))
    if qkv.bias is not None:
        _scale(qkv.bias[v], 1 / s.reshape(-1))


def _smooth_down(mlp: nn.Module, ranges: dict) -> None:
    """down_proj's factors into the up rows of gate_up; an expert that took no calibration
    token is left as it is."""
    down, inner = mlp.down_proj, mlp.down_proj.weight.shape[1]
    if down not in ranges:
        return
    s = factors(ranges[down], column_ranges(down.weight))
    _scale(down.weight, s[None, :])
    _scale(mlp.gate_up.weight[inner:], 1 / s[:, None])
    if mlp.gate_up.bias is not None:
        _scale(mlp.gate_up.bias[inner:], 1 / s)


def _smooth_experts(mlp: nn.Module, norm: nn.Module, ranges: dict) -> None:
    """The layer's input feeds the router and every expert: one factor per channel, from
    the input's range and the widest of their columns, into all of them (the router too,
    so that its float product is unchanged)."""
    mlps = [*mlp.experts, *([mlp.shared] if mlp.shared is not None else [])]
    readers = [m.gate_up.weight for m in mlps] + [mlp.router]
    readers += [mlp.shared_gate] if mlp.shared_gate is not None else []
    w = torch.stack([column_ranges(r) for r in readers]).amax(0)
    s = factors(ranges[mlp], w)
    for r in readers:
        _scale(r, s[None, :])
    _scale(norm.weight, 1 / s)
    for m in mlps:
        _smooth_down(m, ranges)


def smooth_for_int8(model: nn.Module, tokenizer_path: str, block_size: int) -> torch.Tensor:
    """Calibrate on CALIBRATION_TEXT and smooth `model`; the lm_head copy to quantize."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_path)(CALIBRATION_TEXT)["input_ids"]
    return smooth(model, input_ranges(model, ids, block_size))
