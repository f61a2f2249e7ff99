"""Multi-LoRA through a real `subway serve` (every process, HTTP): under load, a fifth adapter
is loaded while four are busy and one of the four is unloaded with its requests in flight;
every answer equals the same request served alone, and nothing is left held."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_lora import make_adapter, random_prompts

from serving import TINY_FLAGS, Server, per_engine, until

MAX_NEW = 48


@pytest.fixture(scope="module")
def five(tiny_models, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("lora_serve")
    base = tiny_models["llama"]
    return [make_adapter(base, str(root / f"a{i}"), r, seed=20 + i)
            for i, r in enumerate((8, 64, 16, 8, 32))]  # fmt: skip


def _ask(url: str, model: str, ids: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_NEW
    return r.json()["choices"][0]["text"]


def _running(url: str) -> float:
    return sum(per_engine(url, "subway:num_requests_running").values())


def test_load_and_unload_under_load(tiny_models, five):
    base = tiny_models["llama"]
    modules = [f"a{i}={p}" for i, p in enumerate(five[:4])]
    flags = (*TINY_FLAGS, "--lora-modules", *modules, "--max-loras", "4", "--max-cpu-loras",
             "4", "--max-lora-rank", "64", "--allow-runtime-lora-updating")  # fmt: skip
    prompts = random_prompts(base, [9, 30, 14, 22, 5, 40, 17, 11, 26, 8], seed=31)
    names = ["tiny", "a0", "a1", "a2", "a3"]
    with Server(base, *flags) as srv:
        url = srv.url
        alone = {
            (i, names[i % 5]): _text(_ask(url, names[i % 5], p)) for i, p in enumerate(prompts)
        }
        with ThreadPoolExecutor(12) as pool:
            busy = {
                (i, names[i % 5]): pool.submit(_ask, url, names[i % 5], p)
                for i, p in enumerate(prompts)
            }
            until(lambda: _running(url) >= 4, within=60)
            r = httpx.post(url + "/v1/load_lora_adapter",
                           json={"lora_name": "a4", "lora_path": five[4]}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            late = pool.submit(_ask, url, "a4", prompts[3])
            r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=30)
            assert r.status_code == 200, r.text
            gone = _ask(url, "a1", prompts[1])
            for key, fut in busy.items():
                assert _text(fut.result()) == alone[key], key  # a1's in flight finish too
            late_text = _text(late.result())
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
        assert _text(_ask(url, "a4", prompts[3])) == late_text  # under load as alone
        models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]
        assert models == ["tiny", "a0", "a2", "a3", "a4"]
        until(lambda: sum(per_engine(url, "subway:lora_loads_total").values()) >= 5, within=10)
        assert sum(per_engine(url, "subway:lora_memory_bytes").values()) > 0
        assert _running(url) == 0
        assert sum(per_engine(url, "subway:kv_cache_usage_perc").values()) == 0
        assert os.path.isdir(five[1])  # an unload forgets the adapter; its folder stays


def test_adapters_reach_every_data_parallel_engine(tiny_models, five):
    """Two engines: an adapter loaded at runtime is announced to both (requests of distinct
    prompts spread over them, and each engine loads it), and an unloaded one to both."""
    base = tiny_models["llama"]
    flags = (*TINY_FLAGS, "-dp", "2", "--lora-modules", f"a0={five[0]}",
             "--max-lora-rank", "64", "--allow-runtime-lora-updating")  # fmt: skip
    prompts = random_prompts(base, [13, 20, 7, 16, 25, 9, 30, 11], seed=41)
    with Server(base, *flags) as srv:
        url = srv.url
        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "a2", "lora_path": five[2]}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: _text(_ask(url, "a2", p)), prompts))
        again = [_text(_ask(url, "a2", p)) for p in prompts]  # whichever engine: the same
        assert texts == again
        loads = per_engine(url, "subway:lora_loads_total")
        assert len(loads) == 2 and all(v >= 1 for v in loads.values()), loads  # both engines
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30)
        assert r.status_code == 200 and _ask(url, "a2", prompts[0]).status_code == 404
        assert _text(_ask(url, "a0", prompts[0]))
