"""`--model FILE.gguf`: a GGUF file (llama.cpp, Ollama, LM Studio) served as it is named.

Subway has no kernels for GGUF's quantized block types yet (Q4_0, Q4_K, Q8_0, ...), so a
file holding any is refused at start, naming its types, unless `--dtype` is given: then
its weights are dequantized at load (a warning says so and what it costs) into a cached
Hugging Face folder, `<cache>/gguf/<name>-<key>` (the key: the file's real path, size
and modification time), with its tokenizer and chat template, by transformers' GGUF
reader; later starts reuse the folder. A file of float tensors only (F32, F16, BF16) needs
no `--dtype`. The `gguf` package reads the tensor types (no parser of our own).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter

from subway.cache_dir import cache_root
from subway.worker.default_model import convert_gguf

log = logging.getLogger(__name__)

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
TYPES_FILE = "gguf_tensor_types.json"  # in the folder: the file's tensor types, counted


class GGUFError(ValueError):
    """A GGUF file that cannot be served as asked (named in the message)."""


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def tensor_types(path: str) -> Counter[str]:
    """How many tensors of each GGUF type the file holds."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
    return Counter(t.tensor_type.name for t in reader.tensors)


def check_types(name: str, types: Counter[str], dtype: str) -> list[str]:
    """The quantized types that will be dequantized at load; raises where `dtype` is
    "auto" and there are any (nothing computes them natively yet)."""
    quantized = sorted(t for t in types if t not in FLOAT_TYPES)
    if quantized and dtype == "auto":
        counts = ", ".join(f"{t} ({types[t]} tensors)" for t in quantized)
        raise GGUFError(
            f"{name}: its tensor types {counts} have no native kernels in Subway yet; pass "
            "--dtype float32 or bfloat16 to dequantize them at load"
        )
    return quantized


def gguf_folder(path: str, dtype: str, quiet: bool = False) -> str:
    """The Hugging Face folder that serves the GGUF file at `path` (made on first use; its
    tensor types kept beside it, `TYPES_FILE`: reading them from a 100 MB file takes 2 s,
    and every process of an engine resolves the model)."""
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    name = os.path.basename(path)
    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = os.path.join(cache_root(), "gguf", f"{name[: -len('.gguf')]}-{digest}")
    made = os.path.exists(os.path.join(out, "model.safetensors"))
    types = None
    if made:
        try:
            with open(os.path.join(out, TYPES_FILE)) as f:
                types = Counter({str(k): int(v) for k, v in json.load(f).items()})
        except (OSError, ValueError, AttributeError):
            types = None
    if types is None:
        types = tensor_types(path)
    quantized = check_types(name, types, dtype)
    if quantized:
        log.warning(
            "%s: dequantizing %s at load to %s (no native kernels yet): the weights take "
            "several times the file's memory", name, ", ".join(quantized), dtype,
        )  # fmt: skip
    if not made:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        convert_gguf(os.path.dirname(os.path.abspath(path)), name, out, quiet=quiet)
        with open(os.path.join(out, TYPES_FILE), "w") as f:
            json.dump(dict(types), f)
    return out
