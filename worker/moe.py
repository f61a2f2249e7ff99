"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) on the Llama family's parts.

A routed layer's MLP is `Experts`: a router picks each token's top-k experts (softmax in
float32, then top-k, renormalised where the model says so), the step's (token, expert)
pairs are sorted by expert, and each expert that has tokens runs its MLP once, on all of
them, through the same linear layers as a dense MLP (`PackedLinear`: the few-row kernels,
oneDNN's packed matmul, `--quantization int8`). The expert outputs are weighted and added
back to their tokens in expert order, the order transformers adds them in. The other
layers (Qwen's `mlp_only_layers`, `decoder_sparse_step`) keep the dense MLP.

Tensor parallelism shards every expert's MLP as a dense one (gate and up by output rows,
down by input columns); the router is replicated, and one all-reduce sums a layer's
experts (and the shared expert) on all ranks.

What differs by model, as transformers computes it:
- Mixtral: experts under `block_sparse_moe` (w1 gate, w3 up, w2 down), always renormalised;
  the routing weights stay float32 until they scale the expert outputs;
- Qwen2-MoE: a shared expert beside the routed ones, scaled by sigmoid(its gate);
- OLMoE: q and k are normed over all heads at once (`FullNorm`), not per head.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from subway.worker.layers import MergedColumnParallelLinear, RowParallelLinear, empty_param
from subway.worker.model import CausalLM, DecoderLayer, ModelArch
from subway.worker.parallel import TensorParallel

# A checkpoint's expert weight (Mixtral's names mapped by `checkpoint_name`).
_EXPERT = re.compile(
    r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)
_ROUTER = re.compile(r"model\.layers\.(?P<i>\d+)\.mlp\.gate\.weight")
_SHARED = re.compile(r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert(?P<rest>_gate\.weight|\..+)")
_QK_NORM = re.compile(r"model\.layers\.(?P<i>\d+)\.self_attn\.(?P<which>q|k)_norm\.weight")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExpertMLP(nn.Module):
    """One expert's gated MLP, its output this rank's partial sum (no all-reduce: `Experts`
    sums the experts first and reduces once)."""

    def __init__(self, hidden: int, size: int, tp: TensorParallel, kernels, dtype, device) -> None:
        super().__init__()
        self._act_and_mul = kernels.silu_and_mul
        self.gate_up = MergedColumnParallelLinear(hidden, [size, size], False, tp, dtype, device)
        self.down_proj = RowParallelLinear(size, hidden, False, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self._act_and_mul(self.gate_up.matmul(x, None)), None)

    def load(self, proj: str, tensor: torch.Tensor) -> None:
        """`proj`: gate, up or down."""
        if proj == "down":
            self.down_proj.load("weight", tensor)
        else:
            self.gate_up.load(0 if proj == "gate" else 1, "weight", tensor)


class Experts(nn.Module):
    """A routed layer's MLP: the router, the experts, and the shared expert where the model
    has one. `tokens`: the model's per-expert token counts, which every routed layer adds to."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, kernels, dtype, device, tokens) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalise = arch.experts_per_token, arch.norm_topk_prob
        self.tokens: np.ndarray = tokens
        # Mixtral scales by float32 weights; the others round them to the model's dtype first.
        self.weights_dtype = torch.float32 if arch.family == "mixtral" else dtype
        # float32 whatever the model's dtype: a bfloat16 matmul of a few rows by 8 outputs
        # cost 35 us a layer, a float32 one 7 (and the softmax reads float32 anyway).
        self.router = empty_param((arch.num_experts, arch.hidden_size), torch.float32, device)
        args = (arch.hidden_size, arch.moe_intermediate_size, tp, kernels, dtype, device)
        self.experts = nn.ModuleList(ExpertMLP(*args) for _ in range(arch.num_experts))
        self.shared: ExpertMLP | None = None
        self.shared_gate: nn.Parameter | None = None
        if arch.shared_expert_size:
            self.shared = ExpertMLP(arch.hidden_size, arch.shared_expert_size, *args[2:])
            self.shared_gate = empty_param((1, arch.hidden_size), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x.float(), self.router).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(self.weights_dtype)
        out = (
            self._one_token(x, weights, chosen)
            if x.shape[0] == 1
            else self._grouped(x, weights, chosen)
        )
        if self.shared is not None:
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return self.tp.all_reduce(out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
        """A single stream's decode: its experts in ascending order (as `_grouped` adds
        them), without the sort and gathers."""
        ids = chosen[0].tolist()
        out = torch.zeros_like(x)
        for j in sorted(range(len(ids)), key=ids.__getitem__):
            out += (self.experts[ids[j]](x) * weights[0, j]).to(x.dtype)
            self.tokens[ids[j]] += 1
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
        """Each expert's MLP once, on all of its tokens (see the module doc)."""
        # The step's (token, expert) pairs grouped by expert, tokens in order within each.
        flat = chosen.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token = order.div(self.top_k, rounding_mode="floor")
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                ys[start : start + n] = expert(xs[start : start + n])
                start += n
        self.tokens += counts
        ys = (ys * weights.view(-1).index_select(0, order)[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


class FullNorm(nn.Module):
    """OLMoE's q or k norm: RMS over all of a token's heads at once (`x [n, heads, d]`) of
    `width` values. Under tensor parallelism each rank holds `size` of them from `first`:
    the squares are summed across ranks."""

    def __init__(self, width: int, first: int, size: int, eps: float, tp, dtype, device) -> None:
        super().__init__()
        self.tp, self.eps, self.width, self.first = tp, eps, width, first
        self.weight = empty_param((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1).float()
        sq = flat.pow(2).sum(-1, keepdim=True)
        if self.tp.world_size > 1:
            sq = self.tp.all_reduce(sq)
        y = (flat * torch.rsqrt(sq / self.width + self.eps)).to(x.dtype)
        return (self.weight * y).view_as(x)

    def load(self, tensor: torch.Tensor) -> None:
        self.weight.copy_(tensor[self.first : self.first + self.weight.numel()])


class MoECausalLM(CausalLM):
    """A mixture-of-experts model: the Llama family's layers, routed MLPs where the arch says."""

    def __init__(self, arch: ModelArch, tp, dtype, device, max_positions: int, kernels) -> None:
        # Tokens each expert took since start, summed over layers (`/metrics`).
        self.expert_tokens = np.zeros(arch.num_experts, dtype=np.int64)
        super().__init__(arch, tp, dtype, device, max_positions, kernels)

    def make_layer(self, arch: ModelArch, i: int, tp, kernels, dtype, device) -> nn.Module:
        layer = DecoderLayer(arch, tp, kernels, dtype, device)
        if arch.moe_layers[i]:
            layer.mlp = Experts(arch, tp, kernels, dtype, device, self.expert_tokens)
        if arch.qk_norm_full:
            attn, d, eps = layer.self_attn, arch.head_dim, arch.rms_norm_eps
            q, rest = attn.qkv, (eps, tp, dtype, device)
            attn.q_norm = FullNorm(arch.num_heads * d, q.q_start * d, q.q_size, *rest)
            attn.k_norm = FullNorm(arch.num_kv_heads * d, q.kv_start * d, q.kv_size, *rest)
        return layer

    def checkpoint_name(self, key: str) -> str | None:
        """Mixtral's `block_sparse_moe` (experts' w1, w3, w2) under the Qwen MoEs' names."""
        if ".block_sparse_moe." not in key:
            return key
        key = key.replace(".block_sparse_moe.", ".mlp.")
        parts = key.split(".")
        if len(parts) == 8 and parts[6] in _MIXTRAL:  # model.layers.i.mlp.experts.e.w1.weight
            parts[6] = _MIXTRAL[parts[6]]
        return ".".join(parts)

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        arch = self.arch
        projs = ("gate", "up", "down")
        for i, routed in enumerate(arch.moe_layers):
            if not routed:
                continue
            p = f"model.layers.{i}.mlp."
            names -= {f"{p}{x}_proj.weight" for x in projs}
            names.add(p + "gate.weight")
            for e in range(arch.num_experts):
                names |= {f"{p}experts.{e}.{x}_proj.weight" for x in projs}
            if arch.shared_expert_size:
                names.add(p + "shared_expert_gate.weight")
                names |= {f"{p}shared_expert.{x}_proj.weight" for x in projs}
        return names

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        tensor = tensor.to(self.embed_tokens.dtype)
        if m := _EXPERT.fullmatch(name):
            self.layers[int(m["i"])].mlp.experts[int(m["e"])].load(m["proj"], tensor)
            return True
        if m := _ROUTER.fullmatch(name):
            _copy_same(self.layers[int(m["i"])].mlp.router, tensor, name)
            return True
        if m := _SHARED.fullmatch(name):
            mlp = self.layers[int(m["i"])].mlp
            if m["rest"] == "_gate.weight":
                _copy_same(mlp.shared_gate, tensor, name)
            else:  # .gate_proj.weight
                mlp.shared.load(m["rest"].split(".")[1].removesuffix("_proj"), tensor)
            return True
        if self.arch.qk_norm_full and (m := _QK_NORM.fullmatch(name)):
            getattr(self.layers[int(m["i"])].self_attn, m["which"] + "_norm").load(tensor)
            return True
        return super().load_weight(name, tensor)


def _copy_same(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(tensor)
