"""Loads subway_pydoc_lastword.jsonl (beside this file) for lm-eval's `custom_dataset`."""

from __future__ import annotations

import json
import pathlib
from typing import Any

DATA = pathlib.Path(__file__).resolve().parent / "subway_pydoc_lastword.jsonl"


def load_dataset(**_: Any) -> dict[str, Any]:
    """{"test": a `datasets.Dataset` of the committed examples}; lm-eval's metadata is ignored."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line]
    return {"test": datasets.Dataset.from_list(rows)}
