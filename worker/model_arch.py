"""A model's architecture, as the worker reads it from a Hugging Face folder's config.json
(and generation_config.json): `ModelArch`. Not to be confused with `ipc.config.ModelConfig`,
which says what to load and how."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

# Hugging Face architecture (or model_type) -> the native model family that runs it.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "olmoe": "olmoe",
}  # fmt: skip
# Vision-language checkpoints whose text model Subway runs -> that text model's architecture.
MULTIMODAL = {("Gemma3ForConditionalGeneration",): "Gemma3ForCausalLM"}
# Config fields that change the model and that Subway does not implement (but for the
# families in IMPLEMENTED): a model that sets one is refused at start, never run wrong.
IMPLEMENTED = {"gemma2": ("attn_logit_softcapping", "final_logit_softcapping")}
UNSUPPORTED_FIELDS = (
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "clip_qkv",  # OLMo: q, k and v clamped
)
# Mixture-of-experts families (`worker/moe.py`) -> the dense family whose attention they share.
MOE_FAMILIES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "llama", "olmoe": "llama"}

LAYER_KINDS = ("full_attention", "sliding_attention")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelArch:
    family: str  # "llama", "qwen2", "qwen3", "gemma2", "gemma3" or one of MOE_FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope_parameters other than the default kind
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before rope
    dtype: torch.dtype  # the checkpoint's dtype
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3 (`worker/gemma.py`): GeGLU, the attention's scale (query_pre_attn_scalar ** -0.5),
    # which layers slide ("sliding_attention", "full_attention"), their own rope base.
    hidden_act: str = "silu"
    attn_scale: float | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None
    # Mixture of experts (`worker/moe.py`, num_experts 0: dense): which layers route (the
    # others run the dense MLP of intermediate_size), how many experts a token takes, whether
    # their weights are renormalised to sum to 1, and a shared expert (Qwen2-MoE) of its size.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[bool] = field(default_factory=list)
    shared_expert_size: int = 0
    qk_norm_full: bool = False  # OLMoE: q and k normed over all heads at once, not per head
    # Gemma 2: scores and logits soft-capped, cap * tanh(x / cap) (0: not capped).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0


def load_model_arch(path: str) -> ModelArch:
    """Parse `path/config.json`; raise ValueError for an architecture Subway does not run."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return parse_model_arch(cfg, _generation_eos(path))


def parse_model_arch(cfg: dict, generation_eos: list[int] | None = None) -> ModelArch:
    if MULTIMODAL.get(tuple(cfg.get("architectures") or ())) and "text_config" in cfg:
        # The text model of a vision-language checkpoint (its images are not served).
        text = {"eos_token_id": cfg.get("eos_token_id"), **cfg["text_config"]}
        text["architectures"] = [MULTIMODAL[tuple(cfg["architectures"])]]
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        return parse_model_arch(text, generation_eos)
    family = _family(cfg)
    dense = MOE_FAMILIES.get(family, family)  # the attention's family
    quantized = cfg.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else "?"
        raise ValueError(
            f"a checkpoint quantized beforehand ({method}): Subway loads float weights; "
            "give it the unquantized folder, with --quantization int8 to quantize at load"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    gemma = family in ("gemma2", "gemma3")
    if act not in (("gelu_pytorch_tanh",) if gemma else ("silu",)):
        raise ValueError(f"unsupported hidden activation {act!r} for {family}")
    for name in UNSUPPORTED_FIELDS:
        if cfg.get(name) and name not in IMPLEMENTED.get(family, ()):
            raise ValueError(f"unsupported config field {name}={cfg[name]!r}: not implemented")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta, scaling = _rope(cfg)
    local_theta, layer_types = None, []
    if gemma:
        theta, scaling, local_theta, layer_types = _gemma_layers(cfg, family)
    attention_bias = bool(cfg.get("attention_bias", False))
    window, layer_types = _window(cfg, family, layer_types)
    eos = _as_list(cfg.get("eos_token_id"))
    for t in generation_eos or []:
        if t not in eos:
            eos.append(t)
    return ModelArch(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("qkv_bias", True)) if dense == "qwen2" else attention_bias,
        o_bias=False if dense == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=dense in ("qwen3", "gemma3") or family == "olmoe",
        dtype=_DTYPES.get(
            str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), torch.float32
        ),
        sliding_window=window,
        eos_token_ids=eos,
        hidden_act=act,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        **(_moe(cfg, family) if family in MOE_FAMILIES else {}),
    )


def resolve_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: float32 on the CPU, the checkpoint's dtype on CUDA; explicit names are honoured."""
    if name == "auto":
        return model_dtype if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _family(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if archs:
        raise ValueError(
            f"unsupported architecture {archs}: Subway runs {', '.join(sorted(ARCHITECTURES))}"
        )
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model_type {model_type!r}: Subway runs {', '.join(sorted(MODEL_TYPES))}"
    )


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """rope theta and scaling from transformers-5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling {kind!r}: default, linear, llama3")
    if kind == "llama3":
        params.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
        )
    return theta, params


def _gemma_layers(cfg: dict, family: str) -> tuple[float, dict | None, float, list[str]]:
    """Gemma's global rope (base, scaling), its sliding layers' rope base, and each
    layer's kind, from transformers-5 `rope_parameters` per layer kind or the older
    `rope_theta`, `rope_scaling`, `rope_local_base_freq` and `sliding_window_pattern`
    (Gemma 2: every other layer slides, one rope for both kinds)."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if not kinds:
        default = 2 if family == "gemma2" else 6
        pattern = int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default
        )
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]  # fmt: skip
    if len(kinds) != n or set(kinds) - set(LAYER_KINDS):
        raise ValueError(f"unsupported layer_types {kinds!r}")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer kind
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        theta, scaling = _rope({**cfg, "rope_parameters": full, "rope_scaling": None})
        local_theta, local_scaling = _rope({**cfg, "rope_parameters": local, "rope_scaling": None})
        if local_scaling is not None:
            raise ValueError("unsupported rope scaling on sliding layers")
        return theta, scaling, local_theta, list(kinds)
    theta, scaling = _rope(cfg)
    if family == "gemma2":
        return theta, scaling, theta, list(kinds)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10000.0)), list(kinds)


def _window(cfg: dict, family: str, layer_types: list[str]) -> tuple[int | None, list[str]]:
    """The sliding window and each layer's kind, as transformers reads them: Gemma's
    `sliding_attention` layers; every layer of Mistral and Mixtral (`sliding_window` set);
    a config's own `layer_types` (Qwen2 and Qwen3 write theirs). Qwen's `use_sliding_window`
    without `layer_types` keeps the window with no layer kinds: the runner then keeps every
    sequence inside it (`model.max_model_len`). Llama's own model ignores `sliding_window`."""
    size = cfg.get("sliding_window")
    if family in ("gemma2", "gemma3"):
        return (int(size or 4096) if "sliding_attention" in layer_types else None), layer_types
    if not size or not cfg.get("use_sliding_window", True):
        return None, []
    kinds = cfg.get("layer_types")
    if kinds:
        if len(kinds) != cfg["num_hidden_layers"] or set(kinds) - set(LAYER_KINDS):
            raise ValueError(f"unsupported layer_types {kinds!r}")
        return (int(size), list(kinds)) if LAYER_KINDS[1] in kinds else (None, [])
    archs = set(cfg.get("architectures") or ())
    if archs & {"MistralForCausalLM", "MixtralForCausalLM"} or (
        not archs and cfg.get("model_type") in ("mistral", "mixtral")
    ):
        return int(size), [LAYER_KINDS[1]] * cfg["num_hidden_layers"]
    if family in ("llama", "olmoe"):
        return None, []
    return int(size), []  # Qwen: use_sliding_window from max_window_layers on


def _moe(cfg: dict, family: str) -> dict:
    """ModelArch's mixture-of-experts fields from a config (Mixtral: `num_local_experts`,
    always renormalised, every layer routed; the Qwen MoEs: `decoder_sparse_step` and
    `mlp_only_layers` pick the routed layers)."""
    n = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{family}: {experts} experts, {top_k} a token: not a mixture of experts")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=experts,
        experts_per_token=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=True if family == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        moe_layers=[i not in dense_only and (i + 1) % step == 0 for i in range(n)],
        shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if family == "qwen2_moe"
        else 0,
        qk_norm_full=family == "olmoe",
    )


def _generation_eos(path: str) -> list[int]:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen):
        return []
    with open(gen) as f:
        return _as_list(json.load(f).get("eos_token_id"))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
