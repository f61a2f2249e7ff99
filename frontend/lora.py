"""LoRA adapters as the frontend sees them: checked before any process loads one, and
named by the `model` of each request.

`inspect_adapter` reads a PEFT folder without torch: `adapter_config.json`, and the
header of `adapter_model.safetensors` (8 bytes of little-endian length, then JSON: the
name, dtype, shape and byte range of each tensor). It refuses what the workers could
not apply or would apply wrongly, each with its reason (`LoraError`): a rank above
`--max-lora-rank`; target modules other than the decoder layers' q/k/v/o and
gate/up/down projections; a `target_modules` regular expression; DoRA, biases,
`fan_in_fan_out`, `modules_to_save`, `layers_to_transform`, per-module ranks; and
every tensor whose shape is not the base model's (its `config.json`: a mismatch names
the layer, the module and both shapes).

`LoraRegistry` holds the adapters served, by name. The `--lora-modules` adapters get
ids 1..n in the order given; the scheduler and the workers register those from the
config themselves. Adapters loaded at runtime (`POST /v1/load_lora_adapter`) get
n+1, n+2, ...: an id is never reused, so a late delta or plan can never be taken for
another adapter's. The frontend sends `AddLora` for those to every engine's scheduler.
An unload forgets the name at once (new requests for it get 404) and sends
`RemoveLora`: each scheduler lets the adapter's requests in flight finish, then drops
it. `resolve` maps a request's `model` to the id that `AddRequest.lora` carries (0: the
base model).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from subway.frontend.errors import APIError
from subway.ipc.config import EngineConfig
from subway.ipc.messages import LoraAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Each module the workers can adapt, and the block of the decoder layer that holds it.
TARGETS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
MAX_ADAPTERS = 1024  # served at once; the workers keep --max-cpu-loras of them loaded
MAX_NAME_CHARS = 128
MAX_JSON_BYTES = 1 << 20  # adapter_config.json and the model's config.json
MAX_HEADER_BYTES = 16 << 20  # a safetensors header (thousands of tensors fit in far less)
_TENSOR = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


class LoraError(ValueError):
    """An adapter that cannot be served, and why (one line)."""


@dataclass(frozen=True)
class AdapterInfo:
    """What `inspect_adapter` found in a PEFT folder."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # the modules it adapts, in TARGETS' order
    layers: tuple[int, ...]  # the decoder layers it adapts
    nbytes: int  # of its weights
    base_model: str = ""  # adapter_config.json's base_model_name_or_path (informational)

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by: alpha / r (alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class ModelShape:
    """The base model's dimensions, from its config.json."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int

    @classmethod
    def from_folder(cls, model_path: str) -> ModelShape:
        cfg = _read_json(os.path.join(model_path, "config.json"), "the base model's config.json")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(
                hidden=hidden,
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise LoraError(f"the base model's config.json lacks a dimension: {e}") from None

    def dims(self, module: str) -> tuple[int, int]:
        """(in, out) features of one of the TARGETS."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[module]  # fmt: skip


def inspect_adapter(
    path: str, model_path: str, max_rank: int, name: str = "", shape: ModelShape | None = None
) -> AdapterInfo:
    """The adapter in the PEFT folder `path`, checked against the model in `model_path`
    (or its `shape`, read already); LoraError says what is wrong with it."""
    if not os.path.isdir(path):
        raise LoraError(f"{path} is not a folder (a local PEFT folder is expected)")
    cfg = _read_json(os.path.join(path, CONFIG_FILE), CONFIG_FILE)
    rank, alpha, rslora = check_adapter_config(cfg, max_rank)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        other = " (adapter_model.bin is not read: convert it)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""  # fmt: skip
        raise LoraError(f"no {WEIGHTS_FILE} in {path}{other}")
    tensors = read_safetensors_header(weights)
    model = shape if shape is not None else ModelShape.from_folder(model_path)
    targets, layers, nbytes = check_tensors(tensors, rank, model)
    base = cfg.get("base_model_name_or_path")
    return AdapterInfo(
        name=name, path=path, rank=rank, alpha=alpha, use_rslora=rslora, targets=targets,
        layers=layers, nbytes=nbytes, base_model=base if isinstance(base, str) else "",
    )  # fmt: skip


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise LoraError(f"{what} not found ({path})") from None
    except OSError as e:
        raise LoraError(f"cannot read {what}: {e.strerror}") from None
    if len(data) > MAX_JSON_BYTES:
        raise LoraError(f"{what} is larger than {MAX_JSON_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise LoraError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LoraError(f"{what} is not a JSON object")
    return obj


def check_adapter_config(cfg: dict[str, Any], max_rank: int) -> tuple[int, float, bool]:
    """(rank, alpha, use_rslora) of an adapter_config.json that the workers can apply."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"peft_type {peft_type!r}: only LORA adapters are served")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        raise LoraError(f"adapter_config.json's r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise LoraError(f"the adapter's rank {rank} is more than --max-lora-rank {max_rank}")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise LoraError(f"adapter_config.json's lora_alpha must be a number, not {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise LoraError(
            f"target_modules is a regular expression ({targets[:80]!r}): only a list of "
            "module names is supported"
        )
    for target in targets or ():
        if not isinstance(target, str) or target.rsplit(".", 1)[-1] not in TARGETS:
            raise LoraError(f"target module {str(target)[:80]}: the model has no such layer")
    refused = (
        (cfg.get("use_dora") is True, "DoRA adapters (use_dora) are not supported"),
        (cfg.get("bias", "none") not in ("none", None),
         f"bias {cfg.get('bias')!r}: adapters with bias weights are not supported "
         '(only bias "none")'),
        (cfg.get("fan_in_fan_out") is True, "fan_in_fan_out adapters are not supported"),
        (bool(cfg.get("modules_to_save")),
         "modules_to_save: adapters that replace whole layers are not supported"),
        (cfg.get("layers_to_transform") is not None,
         "layers_to_transform is not supported (an adapter adapts the layers it has weights of)"),
        (bool(cfg.get("rank_pattern")) or bool(cfg.get("alpha_pattern")),
         "rank_pattern and alpha_pattern (per-module ranks) are not supported"),
    )  # fmt: skip
    for bad, reason in refused:
        if bad:
            raise LoraError(reason)
    return rank, float(alpha), cfg.get("use_rslora") is True


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file, by name (dtype, shape, data_offsets), checked to
    lie within the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise LoraError(f"{WEIGHTS_FILE} is truncated")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise LoraError(f"{WEIGHTS_FILE} is not a safetensors file (header of {length} B)")
            raw = f.read(length)
    except OSError as e:
        raise LoraError(f"cannot read {WEIGHTS_FILE}: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise LoraError(f"{WEIGHTS_FILE} is not a safetensors file (its header)") from None
    if not isinstance(header, dict):
        raise LoraError(f"{WEIGHTS_FILE} is not a safetensors file (its header)")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, entry in header.items():
        try:
            start, end = entry["data_offsets"]
            shape, dtype = [int(d) for d in entry["shape"]], str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise LoraError(f"{WEIGHTS_FILE}: tensor {name[:120]!r} is malformed") from None
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data):
            raise LoraError(f"{WEIGHTS_FILE} is truncated (tensor {name[:120]!r})")
        entry["dtype"], entry["shape"] = dtype, shape
        if dtype in DTYPE_BYTES and end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise LoraError(f"{WEIGHTS_FILE}: tensor {name[:120]!r} has the wrong size")
    return header


def check_tensors(
    tensors: dict[str, dict[str, Any]], rank: int, model: ModelShape
) -> tuple[tuple[str, ...], tuple[int, ...], int]:
    """(targets, layers, bytes) of an adapter's tensors, each checked against the model."""
    seen: dict[tuple[int, str], set[str]] = {}
    nbytes = 0
    for name, entry in tensors.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise LoraError(
                f"tensor {name[:120]!r} is not a LoRA weight of a decoder layer's projection"
            )
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if TARGETS.get(module) != block:
            raise LoraError(f"target module {block}.{module}: the model has no such layer")
        if layer >= model.layers:
            raise LoraError(
                f"base model mismatch: layer {layer} {module}: the model has {model.layers} layers"
            )
        if entry["dtype"] not in DTYPE_BYTES:
            raise LoraError(f"tensor {name[:120]!r} is {entry['dtype']}: F32, F16 or BF16 only")
        fan_in, fan_out = model.dims(module)
        need = [rank, fan_in] if ab == "A" else [fan_out, rank]
        have = entry["shape"]
        if have != need:
            ranked = len(have) == 2 and have[0 if ab == "A" else 1] != rank
            what = f"its rank is not r={rank}" if ranked else "base model mismatch"
            raise LoraError(
                f"{what}: layer {layer} {module} lora_{ab} is {have}, the model needs {need}"
            )
        seen.setdefault((layer, module), set()).add(ab)
        nbytes += entry["data_offsets"][1] - entry["data_offsets"][0]
    if not seen:
        raise LoraError(f"{WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            missing = "B" if "A" in parts else "A"
            raise LoraError(f"layer {layer} {module} has no lora_{missing} weight")
    modules = {module for _, module in seen}
    targets = tuple(t for t in TARGETS if t in modules)
    return targets, tuple(sorted({layer for layer, _ in seen})), nbytes


class LoraRegistry:
    """The adapters served, by name; see the module's docstring for ids and their life.
    Used from the event loop; `check` (which reads files) may run on a thread."""

    def __init__(
        self, config: EngineConfig, inspect: Callable[..., AdapterInfo] = inspect_adapter
    ) -> None:
        """Registers and checks each `--lora-modules` adapter (LoraError naming it)."""
        lora = config.lora
        self.enabled = lora.enable_lora
        self.runtime_updates = lora.allow_runtime_lora_updating
        self.base_name = config.model.served_model_name
        self.model_path = config.model.path
        self.max_rank = lora.max_lora_rank
        self._inspect = inspect
        self._shape: ModelShape | None = None
        self._served: dict[str, tuple[LoraAdapter, AdapterInfo]] = {}
        self._names: dict[int, str] = {}  # the same, by id
        self._next_id = 1
        if self.enabled:
            for name, path in lora.modules():
                try:
                    self.register(self.check(name, path))
                except LoraError as e:
                    raise LoraError(f"--lora-modules {name[:MAX_NAME_CHARS]}: {e}") from None

    def resolve(self, model: str | None) -> int:
        """The adapter id a request's `model` names: 0 for the base model (or none named);
        404 for a name that is neither."""
        if model is None or model == self.base_name:
            return 0
        served = self._served.get(model)
        if served is None:
            raise APIError(404, f"the model `{model[:MAX_NAME_CHARS]}` does not exist", "model")
        return served[0].lora_id

    def check(self, name: str, path: str) -> AdapterInfo:
        """The adapter `name` at `path`, inspected (reads files: off the event loop), or
        LoraError. Not registered yet: `register` does that."""
        self.check_name(name)
        if self._shape is None:
            self._shape = ModelShape.from_folder(self.model_path)
        return self._inspect(path, self.model_path, self.max_rank, name=name, shape=self._shape)

    def check_name(self, name: str) -> None:
        """LoraError for a name that may not be served now."""
        if not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
            raise LoraError(f"an adapter's name is 1 to {MAX_NAME_CHARS} printable characters")
        if name == self.base_name:
            raise LoraError(f"{name} is the base model's name")
        if name in self._served:
            raise LoraError(f"an adapter named {name} is already loaded")
        if len(self._served) >= MAX_ADAPTERS:
            raise LoraError(f"{MAX_ADAPTERS} adapters are served already: unload one first")

    def register(self, info: AdapterInfo) -> LoraAdapter:
        """Serve a checked adapter under the next id (LoraError if its name was taken
        meanwhile)."""
        self.check_name(info.name)
        path = os.path.abspath(info.path)
        adapter = LoraAdapter(lora_id=self._next_id, name=info.name, path=path)
        self._next_id += 1
        self._served[info.name] = (adapter, info)
        self._names[adapter.lora_id] = info.name
        return adapter

    def add(self, name: str, path: str) -> LoraAdapter:
        """`check` and `register` in one (on the caller's thread); 400 if refused."""
        try:
            return self.register(self.check(name, path))
        except LoraError as e:
            raise APIError(400, str(e), "lora_path") from None

    def remove(self, name: str) -> int:
        """Stop serving `name` (404 if it is not served); its id, which is never reused."""
        served = self._served.pop(name, None)
        if served is None:
            raise APIError(404, f"no adapter named `{name[:MAX_NAME_CHARS]}` is loaded",
                           "lora_name")  # fmt: skip
        del self._names[served[0].lora_id]
        return served[0].lora_id

    def serves(self, lora_id: int) -> bool:
        """Whether adapter `lora_id` is still served (0, the base model, always is): a
        request resolved before an unload is refused after it, never sent."""
        return lora_id == 0 or lora_id in self._names

    def adapters(self) -> list[tuple[LoraAdapter, AdapterInfo]]:
        """The adapters served, in the order of their ids."""
        return sorted(self._served.values(), key=lambda s: s[0].lora_id)

    def names(self) -> dict[int, str]:
        """Each served adapter's name, by id."""
        return dict(self._names)
