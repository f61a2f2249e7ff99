"""`--model FILE.gguf` (worker/gguf_file.py): refused where its types have no kernels and no
`--dtype` was given; with one, dequantized at load into a cached folder, served as the
default model (the same file, converted the same way) is."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import pytest
import torch

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.worker.default_model import GGUF_FILE, GGUF_PACKAGE
from subway.worker.gguf_file import GGUFError, check_types, gguf_folder, tensor_types


def _default_gguf() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    assert spec is not None and spec.origin is not None
    return os.path.join(os.path.dirname(spec.origin), GGUF_FILE)


def test_its_types_are_read_and_the_quantized_ones_refused_without_a_dtype():
    types = tensor_types(_default_gguf())
    assert types == Counter({"Q4_1": 210, "F32": 61, "Q8_0": 1})
    with pytest.raises(GGUFError, match=r"Q4_1 \(210 tensors\), Q8_0 \(1 tensors\).*--dtype"):
        check_types(GGUF_FILE, types, "auto")
    assert check_types(GGUF_FILE, types, "bfloat16") == ["Q4_1", "Q8_0"]
    assert check_types("f.gguf", Counter({"F32": 3, "BF16": 9, "F16": 1}), "auto") == []


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        gguf_folder(str(tmp_path / "none.gguf"), "float32")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_folder(str(bad), "float32")


def test_serve_refuses_it_at_start_with_its_types(capsys):
    from subway.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", _default_gguf()])
    assert e.value.code == 2
    assert "Q4_1 (210 tensors)" in capsys.readouterr().err


def test_with_a_dtype_it_serves_as_the_default_model(tmp_path, monkeypatch, default_model):
    """Converted into a folder under the cache (once: a second start reuses it), named after
    the file: the default model's weights and tokenizer (the same file, converted the same
    way), and greedy output equal to transformers' on it."""
    from safetensors.torch import load_file

    from subway.llm import LLM
    from subway.tools.cli import resolve_model

    import reference

    torch.set_num_threads(2)
    # Its folder under tmp_path (not SUBWAY_CACHE: the kernels' builds live there too).
    monkeypatch.setattr("subway.worker.gguf_file.cache_root", lambda: str(tmp_path))
    config = resolve_model(EngineConfig.build(path=_default_gguf(), dtype="float32"))
    folder = config.model.path
    assert folder.startswith(str(tmp_path / "gguf")) and os.path.isdir(folder)
    assert config.model.served_model_name == GGUF_FILE[: -len(".gguf")]
    weights = os.path.join(folder, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    again = resolve_model(EngineConfig.build(path=_default_gguf(), dtype="float32"))
    assert again.model.path == folder and os.stat(weights).st_mtime_ns == stamp
    ours, theirs = load_file(weights), load_file(os.path.join(default_model, "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(folder, name)) as a, open(os.path.join(default_model, name)) as b:
            assert a.read() == b.read(), name
    engine = LLM(config.replace(threads=2, num_kv_blocks=256))
    prompt = engine.tokenizer("The capital of France is")["input_ids"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = engine.generate([prompt], sp)[0].token_ids
    assert got == reference.hf_greedy(folder, prompt, 12).tokens
