"""Weight loading from every *.safetensors file of a Hugging Face folder, sharded on load."""

from __future__ import annotations

import glob
import os

from safetensors import safe_open

from subway.worker.model import CausalLM

# Checkpoint entries that carry no weights the model needs.
_IGNORED = ("rotary_emb.inv_freq",)


def load_weights(model: CausalLM, path: str) -> None:
    """Copy every weight of the checkpoint at `path` into `model`; raise if any is missing or unknown."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    seen: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = None if key.endswith(_IGNORED) else model.checkpoint_name(key)
                if name is None:  # a part of the checkpoint the model does not run
                    continue
                if not model.load_weight(name, f.get_tensor(key)):
                    raise ValueError(f"unexpected weight {key!r} in {file}")
                seen.add(name)
    missing = model.expected_weights() - seen
    if missing:
        raise ValueError(f"weights missing from {path}: {sorted(missing)[:8]}")
