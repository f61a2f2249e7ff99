"""The whole engine through `subway serve`: three kinds of process, real sockets, real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from subway.tools.proc_title import parse

from reference import hf_greedy
from serving import Server


@pytest.fixture(scope="module")
def server(tiny_models):
    # A small pool and budget so that chunking and block reuse happen in every test.
    s = Server(
        tiny_models["llama"],
        "--served-model-name", "tiny",
        "--max-num-batched-tokens", "64",
        "--num-kv-blocks", "96",
        "--max-model-len", "512",
    )  # fmt: skip
    yield s
    s.stop()


def test_three_processes_serve(server):
    kinds = sorted(parse(c.cmdline())["kind"] for c in server.children())
    assert kinds == ["frontend", "scheduler", "worker"]
    # Only the worker loads torch (a start-up check or a tokenizer load could pull it in
    # anywhere, several seconds of each process's start).
    with_torch = sorted(
        parse(c.cmdline())["kind"]
        for c in server.children()
        if any("libtorch_cpu" in m.path for m in c.memory_maps())
    )
    assert with_torch == ["worker"]
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_concurrent_requests_match_transformers(server, tiny_models):
    """Streaming and non-streaming, both endpoints, at once; greedy tokens equal transformers'."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    prompts = [
        "The quick brown fox",
        "Once upon a time, in a land far away, there lived " * 6,  # longer than the budget
        "1 2 3 4 5 6 7",
        "Hello",
        "Paris is the capital of",
        "def fib(n):",
        "A B C",
        "Subway trains run every few minutes because",
    ]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
    max_tokens = 12

    async def completion(prompt: str, stream: bool) -> str:
        args = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        args["extra_body"] = {"ignore_eos": True}
        if not stream:
            out = await client.completions.create(**args)
            assert out.usage.completion_tokens == max_tokens
            assert out.choices[0].finish_reason == "length"
            return out.choices[0].text
        text = ""
        async for chunk in await client.completions.create(**args, stream=True):
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def chat(stream: bool) -> str:
        args = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        args["temperature"] = 0.0
        if not stream:
            return (await client.chat.completions.create(**args)).choices[0].message.content
        text = ""
        async for chunk in await client.chat.completions.create(**args, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text

    async def run():
        jobs = [completion(p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
        jobs += [completion(p, stream=i % 2 == 1) for i, p in enumerate(prompts)]
        jobs += [chat(False), chat(True)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    n = len(prompts)
    for i, p in enumerate(prompts):
        assert results[i] == results[n + i], "streaming and non-streaming differ"
        ids = tok(p, add_special_tokens=False)["input_ids"]
        ref = hf_greedy(tiny_models["llama"], ids, max_tokens)
        # Text does not always round-trip to the same ids; compare the decoded text.
        assert results[i] == tok.decode(ref.tokens), f"prompt {i}"
    assert results[-1] == results[-2]


def test_bad_input_gets_400_and_server_keeps_serving(server):
    bad = [
        b"{not json",
        json.dumps({"model": "tiny"}).encode(),
        json.dumps({"model": "tiny", "prompt": 5}).encode(),
        json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(),
        json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 100000}).encode(),
        json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(),
        json.dumps({"model": "tiny", "prompt": "word " * 600}).encode(),
    ]
    for body in bad:
        r = httpx.post(
            server.url + "/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400, (body[:60], r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "other", "prompt": "x", "max_tokens": 2},
    )
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _blocks_settle(server, want_free: float, within: float = 5.0) -> dict[str, float]:
    """Poll /metrics until the free-block count reaches `want_free`, for at most `within` s."""
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        settled = m.get("subway:kv_blocks_free") == want_free
        if (settled and m.get("subway:num_requests_running") == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)  # stats arrive with each step and a heartbeat; this only paces the poll


def test_blocks_return_on_finish_and_disconnect(server):
    total = 96.0
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "count " * 40, "max_tokens": 20, "ignore_eos": True},
    )
    assert r.status_code == 200
    m = _blocks_settle(server, total)
    assert m["subway:kv_blocks_free"] == total
    # The step counters behind the overlap benchmark move with the work done.
    assert m["subway:num_steps_total"] >= 20  # 20 decodes at least
    assert m["subway:worker_busy_seconds_total"] > 0
    assert 0 <= m["subway:worker_idle_seconds_total"]

    # A streaming client that goes away mid-answer: its request is aborted and freed.
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "go " * 40, "max_tokens": 400, "ignore_eos": True,
              "stream": True},
    ) as resp:  # fmt: skip
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 3:
                break
    m = _blocks_settle(server, total)
    assert m["subway:kv_blocks_free"] == total
    assert m["subway:num_requests_running"] == 0


def test_shutdown_leaves_nothing(tiny_models):
    s = Server(tiny_models["qwen2"], "--num-kv-blocks", "32")
    pids = [c.pid for c in s.children()]
    assert len(pids) == 3
    assert s.shm_files(), "the shared-memory token buffers exist while serving"
    assert s.stop(signal.SIGTERM) == 0
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert s.shm_files() == []
    assert not os.path.exists(f"/tmp/subway-{s.run_id}")


def test_dead_worker_stops_everything(tiny_models):
    s = Server(tiny_models["qwen3"], "--num-kv-blocks", "32")
    pids = [c.pid for c in s.children()]
    s.child("worker").kill()
    assert s.proc.wait(30) != 0
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert s.shm_files() == []
    assert "worker 0 exited" in s.read_output()


@pytest.mark.slow
def test_default_model_answers_in_english(default_model):
    s = Server("", "--max-model-len", "1024")
    try:
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 30,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        assert s.stop() == 0
