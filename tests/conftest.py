"""Shared fixtures: the default model (converted once), tiny random-weight models and the
session's live servers; the `live` mark.

Tiny models are built with `transformers` from a seed and saved in Hugging
Face format with the default model's tokenizer, once per test session.

Two tiers by default (`make test` runs both; `make test-unit` the first): unit tests start
no `subway serve`; live tests (marked `live` here, at collection) are those of a module
that uses the serving harness (`tests/serving.py`, `subway.tools.serve_process`). `slow`
(marked by hand) is a third tier, outside the default run.
"""

from __future__ import annotations

import inspect
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Tests in parallel processes (`make test`: two): one OpenMP thread each, for the
    # engines they start too (the worker's torch reads it). With two threads each, two
    # engines' threads spin against each other on 2 cores: the run took longer than one
    # process (over 12 minutes against 11; 7.6 with one thread each).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _share_one_ssl_context() -> None:
    """Every httpx client made without TLS settings (each `httpx.get(...)` makes one) shares
    one default SSL context: each made its own, loading the CA bundle, 25 ms of CPU per call
    against 0.2 ms, and the tests' polls of /health and /metrics call it every 20 ms. The
    tests speak plain HTTP to loopback; no TLS setting changes."""
    import functools

    from httpx._transports import default

    make = getattr(default, "create_ssl_context", None)
    if make is None:  # another httpx: each call makes its own, as before
        return

    @functools.wraps(make)
    def shared(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return context()
        return make(verify=verify, cert=cert, trust_env=trust_env)

    context = functools.cache(make)
    default.create_ssl_context = shared


_share_one_ssl_context()

TINY_ARCHS = ("llama", "qwen2", "qwen3")
GEMMA2_WINDOW = 24  # build_tiny_model("gemma2"): its sliding window
GEMMA2_CAPS = (2.0, 3.0)  # and its attention and final logit soft-caps


def _uses_the_serving_harness(module) -> bool:
    names = ("serving", "subway.tools.serve_process")
    return any(getattr(v, "__module__", None) in names for v in vars(module).values())


def pytest_collection_modifyitems(config, items) -> None:
    """Marks `live` tests, and orders the modules longest kind first: the live ones, then
    those that run a model (a test takes `default_model` or `tiny_models`), then the rest
    (each kind in its own order). Two test processes (`make test`) end together only when
    the many short modules come last."""
    live = pytest.mark.live
    heavy: set[str] = set()
    for item in items:
        module = getattr(item, "module", None)
        if "servers" in getattr(item, "fixturenames", ()) or (
            module is not None and _uses_the_serving_harness(module)
        ):
            item.add_marker(live)
        function = getattr(item, "function", None)
        takes = inspect.signature(function).parameters if function is not None else {}
        if "default_model" in takes or "tiny_models" in takes:
            heavy.add(item.nodeid.split("::")[0])

    def kind(item) -> int:
        if item.get_closest_marker("live") is not None:
            return 0
        return 1 if item.nodeid.split("::")[0] in heavy else 2

    items.sort(key=kind)  # stable: a module's tests stay together and in order


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """torch's thread count back to what it was after each test: a test that sets it (two
    for a long model run, one for bitwise sums) sets it for itself, not for the tests that
    follow in its process (in `make test`, two threads there meant two processes' threads
    spinning against each other on 2 cores)."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if before is None:  # torch's own default, as its first import chose it
        before = int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model() -> str:
    from subway.worker.default_model import ensure_default_model

    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def gemma3_270m() -> str:
    """The real Gemma 3 270M, dequantized from its Q4_K_M GGUF (`ensure_gemma3_270m`)."""
    from subway.worker.default_model import ensure_gemma3_270m

    return ensure_gemma3_270m()


MOE_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=32,
                  moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
}  # fmt: skip


def build_tiny_model(arch: str, out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
    elif arch == "gemma3":  # 3 sliding layers and a global one; the window holds the tests
        common["num_hidden_layers"] = 4
        config = Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24,
                                  sliding_window=256, layer_types=["sliding_attention"] * 3
                                  + ["full_attention"])  # fmt: skip
        config.architectures = ["Gemma3ForCausalLM"]
    elif arch == "gemma2":  # sliding and global layers in turn, a window shorter than the
        # tests' prompts, and caps small enough to bend this model's scores and logits
        common["num_hidden_layers"] = 4
        config = Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=24,
                              sliding_window=GEMMA2_WINDOW, attn_logit_softcapping=GEMMA2_CAPS[0],
                              final_logit_softcapping=GEMMA2_CAPS[1])  # fmt: skip
        config.architectures = ["Gemma2ForCausalLM"]
    elif arch == "gemma3_vl":  # the vision-language checkpoint: its text model is served
        from transformers import AutoModelForImageTextToText, Gemma3Config, SiglipVisionConfig

        common["num_hidden_layers"] = 3
        text = Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24,
                                sliding_window=256, layer_types=["sliding_attention"] * 2
                                + ["full_attention"])  # fmt: skip
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        config.architectures = ["Gemma3ForConditionalGeneration"]
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    elif arch in MOE_CONFIGS:  # 8 experts, 2 a token; Qwen's middle layer stays dense
        import transformers

        cls, extra = MOE_CONFIGS[arch]
        common.update(num_hidden_layers=3, **extra)
        config = getattr(transformers, cls)(**common)
        config.architectures = [cls.replace("Config", "ForCausalLM")]
    else:
        raise ValueError(arch)
    if arch != "gemma3_vl":
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen it so that greedy choices are decisive, not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # so that a norm weight that is not loaded shows (Gemma's is 1 + weight)
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)  # biases (Qwen2's q/k/v)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def servers():
    """The session's shared live servers (`serving.ServerPool`), one per (model, flags)."""
    from serving import ServerPool

    pool = ServerPool()
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: build_tiny_model(arch, os.path.join(root, arch), default_model) for arch in TINY_ARCHS
    }
