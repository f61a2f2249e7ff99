"""`opt`: a config field with its command-line help (the flags are generated from them)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str = "", **meta: Any) -> Any:
    """A config field with its command-line help; `meta` may name the `flag` (default
    --field-name), its `choices` and an `alias`."""
    return field(default=default, metadata={"help": help, **meta})
