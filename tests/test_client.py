"""`subway.client` against a live `subway serve`: the native ZMQ endpoint
(blocking and asyncio clients) and the HTTP helper."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from subway.client import AsyncClient, Client, HTTPClient, RequestError

from serving import KV_BLOCKS, Server

MODEL = "tiny"
PROMPT = "Subway trains run every few minutes because"


@pytest.fixture(scope="module")
def server(tiny_models):
    s = Server(
        tiny_models["qwen2"], "--served-model-name", MODEL, "--max-model-len", "512", *KV_BLOCKS
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def address(server) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'subway-{server.run_id}')}/client.sock"


@pytest.fixture(scope="module")
def tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2"])


def _settled(server, within: float = 2.0) -> dict[str, float]:
    """/metrics once nothing runs or waits, polling for at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        idle = m["subway:num_requests_running"] == 0 and m["subway:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_zmq_streams_the_same_tokens_as_http(server, address, tok):
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    with Client(address) as client:
        outs = list(client.stream(PROMPT, **params))
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert len(outs) > 1  # streamed, not all at once
    zmq_ids = [t for o in outs for t in o.token_ids]
    zmq_text = "".join(o.text for o in outs)
    assert len(zmq_ids) == 12 and outs[0].prompt_tokens == len(tok.encode(PROMPT))
    assert zmq_text == tok.decode(zmq_ids)

    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "logprobs": 0, **params}
    http_tokens, http_text = [], ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    http_text += ch["text"]
                    http_tokens += ch["logprobs"]["tokens"]
    assert http_text == zmq_text
    assert http_tokens == [tok.decode([t]) for t in zmq_ids]


def test_blocking_client_generate_token_prompts_logprobs_and_errors(address, tok):
    ids = tok.encode(PROMPT)
    with Client(address) as client:
        a = client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
        b = client.generate(ids, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == "length"
        assert b.logprobs is not None and len(b.logprobs) == 6 and all(x <= 0 for x in b.logprobs)
        # Two requests in flight on one client: their answers do not mix.
        r1 = client.submit(PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
        r2 = client.submit("Hello", max_tokens=3, temperature=0, ignore_eos=True)
        out2 = [t for o in client.outputs(r2) for t in o.token_ids]
        out1 = [t for o in client.outputs(r1) for t in o.token_ids]
        assert out1 == a.token_ids[:5] and len(out2) == 3
        s1 = client.generate(PROMPT, max_tokens=6, temperature=1.0, seed=5)
        s2 = client.generate(PROMPT, max_tokens=6, temperature=1.0, seed=5)
        assert s1.token_ids == s2.token_ids
        for bad, status in (
            (dict(prompt=PROMPT, max_tokens=0), 400),
            (dict(prompt=PROMPT, temperature=-1), 400),
            (dict(prompt=[10**9]), 400),
            (dict(prompt=PROMPT, max_tokens=100_000), 400),
            (dict(prompt=PROMPT, top_p="x"), 400),
        ):
            with pytest.raises(RequestError) as e:
                client.generate(**bad)
            assert e.value.status == status, bad
        assert client.generate("still", max_tokens=2).finish_reason is not None


def test_abort_and_leaving_early_free_the_engine(server, address):
    long = dict(max_tokens=400, temperature=0, ignore_eos=True)
    with Client(address) as client:
        rid = client.submit(PROMPT, **long)
        outs = client.outputs(rid)
        next(outs)
        client.abort(rid)
        m = _settled(server, 1.0)
        assert m["subway:num_requests_running"] == 0
        for i, _ in enumerate(client.stream(PROMPT, **long)):
            if i == 2:
                break  # leaving the loop aborts
        m = _settled(server, 1.0)
        assert m["subway:num_requests_running"] == 0
        rid = client.submit(PROMPT, **long)  # closing the client aborts what is in flight
    m = _settled(server, 1.0)
    assert m["subway:num_requests_running"] == 0


def test_a_client_that_dies_is_noticed(server, address):
    code = (
        "import sys, time\n"
        "from subway.client import Client\n"
        "c = Client(sys.argv[1])\n"
        "rid = c.submit('x ' * 20, max_tokens=400, ignore_eos=True, temperature=0)\n"
        "outs = c.outputs(rid)\n"
        "next(outs)\n"
        "print('streaming', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert server.metrics()["subway:num_requests_running"] == 1
        proc.kill()
        proc.wait(10)
        m = _settled(server, 2.0)
        assert m["subway:num_requests_running"] == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def test_async_client(address):
    async def main():
        async with AsyncClient(address) as client:
            greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
            prompts = [PROMPT, "Hello", "1 2 3", PROMPT]
            results = await asyncio.gather(*(client.generate(p, **greedy) for p in prompts))
            assert results[0].token_ids == results[3].token_ids
            assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)
            pieces = []
            async with contextlib.aclosing(client.stream(PROMPT, **greedy)) as outs:
                async for out in outs:
                    pieces.append(out)
            assert [t for o in pieces for t in o.token_ids] == results[0].token_ids
            rid = client.submit(PROMPT, max_tokens=400, temperature=0, ignore_eos=True)
            async with contextlib.aclosing(client.outputs(rid)) as outs:
                await anext(outs)
            with pytest.raises(RequestError):
                await client.generate(PROMPT, top_k=-5)
            return results[0].text

    assert asyncio.run(main())


def test_http_client_helper(server, tok):
    with HTTPClient(server.url) as http:
        assert http.health() and http.model == MODEL
        out = http.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
        text = out["choices"][0]["text"]
        assert "".join(http.stream(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)) == text
        messages = [{"role": "user", "content": "Hi"}]
        content = http.chat(messages, max_tokens=4, temperature=0)["choices"][0]["message"]
        streamed = "".join(http.chat_stream(messages, max_tokens=4, temperature=0))
        assert streamed == content["content"]
        ids = http.tokenize(PROMPT)
        assert ids == tok.encode(PROMPT) and http.detokenize(ids) == PROMPT
        assert "subway:num_requests_running" in http.metrics()
        with pytest.raises(RequestError) as e:
            http.complete(PROMPT, max_tokens=-1)
        assert e.value.status == 400
