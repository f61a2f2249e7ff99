"""int8 weights and activations on the CPU (`--quantization int8`).

Each linear weight is quantized once, after loading and sharding (so under tensor
parallelism each rank quantizes its own shard): symmetric, one float scale per
output channel. At every call the activations are quantized per token (one scale
per row, `Kernels.quantize_rows`), the int8 matmul runs in oneDNN (VNNI or AMX,
`onednn::qlinear_pointwise` on a prepacked weight), and each output row is scaled
back. Embeddings, norms, attention and the lm_head stay in the model's dtype.
"""

from __future__ import annotations

import torch

from subway.ipc.config import EngineConfig


def unsupported_reason(config: EngineConfig, device: torch.device | None = None) -> str | None:
    """Why `--quantization` / `--kv-cache-dtype` cannot run with this config, or None."""
    quant, kv = config.model.quantization, config.cache.kv_cache_dtype
    if quant == "none" and kv == "auto":
        return None
    if device is None:
        want = config.model.device
        cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    else:
        cuda = device.type == "cuda"
    if cuda:
        return "--quantization and --kv-cache-dtype are CPU-only so far (use --device cpu)"
    if quant == "int8":
        if not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.onednn, "qlinear_pointwise"
        ):
            return "--quantization int8 needs torch built with oneDNN's quantized linear"
        if not config.model.cpu_ext:
            return "--quantization int8 needs the C++ CPU kernels (drop --no-cpu-ext)"
    if kv == "int8" and not config.model.cpu_ext:
        return "--kv-cache-dtype int8 needs the C++ CPU kernels (drop --no-cpu-ext)"
    if kv == "int8" and config.model.kernels == "triton":
        return "--kv-cache-dtype int8 has no Triton kernels (drop --kernels triton)"
    return None
