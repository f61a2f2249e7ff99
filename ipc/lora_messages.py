"""The LoRA part of the contract (`ipc/messages.py` re-exports it): the frontend names the
adapters it serves to each engine's scheduler, which passes them on to the workers in plans."""

from __future__ import annotations

import msgspec

from subway.ipc.config import LoraConfig


class LoraAdapter(msgspec.Struct, array_like=True):
    """A LoRA adapter the frontend has checked (`frontend/lora.py`): its id (never reused,
    1 and up), its name in the API, and its PEFT folder, which each worker loads."""

    lora_id: int
    name: str
    path: str


class AddLora(msgspec.Struct, tag="add_lora"):
    """Serve this adapter from now on (`--lora-modules` at start, or /v1/load_lora_adapter)."""

    adapter: LoraAdapter


class RemoveLora(msgspec.Struct, tag="remove_lora"):
    """Stop serving adapter `lora_id`: its requests in flight finish first, then the
    workers forget it."""

    lora_id: int


def startup_adapters(config: LoraConfig) -> list[LoraAdapter]:
    """The adapters of `--lora-modules`, numbered 1..n as every process numbers them."""
    return [LoraAdapter(i, name, path) for i, (name, path) in enumerate(config.modules(), 1)]
