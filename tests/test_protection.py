"""Protection of a live server: API key, loopback bind, size limits, the waiting-queue
bound (429), timeouts, disconnects, and a table of bad requests (4xx, OpenAI-style errors)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import httpx
import openai
import pytest

from subway.client import Client, RequestError
from subway.ipc.config import EngineConfig

from serving import KV_BLOCKS, Server

MODEL = "tiny"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 2048  # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_models):
    s = Server(
        tiny_models["llama"],
        "--served-model-name", MODEL,
        "--api-key", KEY,
        "--max-num-seqs", "2",
        "--max-waiting", "2",
        "--max-model-len", str(CONTEXT),
        *KV_BLOCKS,
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def is_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def metrics(http: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def idle_within(http: httpx.Client, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(http)
        if m["subway:num_requests_running"] == 0 and m["subway:num_requests_waiting"] == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


# ---------------------------------------------------------------- secrets


def test_the_key_is_on_no_child_command_line(server):
    """The launcher hands each process its config on standard input, not in argv: `ps`
    shows no key (the launcher's own argv has it only because this test passed --api-key)."""
    kids = server.children()
    assert len(kids) >= 3
    for kid in kids:
        assert KEY not in " ".join(kid.cmdline()), kid.cmdline()
        assert "SUBWAY_API_KEY" not in kid.environ()


def _key_file(tmp_path, mode: int) -> str:
    path = tmp_path / "key"
    path.write_text("file-key\n")
    os.chmod(path, mode)
    return str(path)


@pytest.mark.slow
def test_the_key_from_a_file_or_the_environment(tiny_models, tmp_path, monkeypatch):
    for flags, env in ((["--api-key-file", _key_file(tmp_path, 0o600)], None), ([], "file-key")):
        if env is not None:
            monkeypatch.setenv("SUBWAY_API_KEY", env)
        s = Server(tiny_models["llama"], "--served-model-name", MODEL, *flags)
        try:
            assert httpx.get(s.url + "/v1/models").status_code == 401
            ok = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer file-key"})
            assert ok.status_code == 200
            assert all("file-key" not in " ".join(k.cmdline()) for k in s.children())
        finally:
            s.stop()


def test_a_key_file_others_can_read_is_refused(tiny_models, tmp_path):
    with pytest.raises(RuntimeError, match="readable by others"):
        Server(tiny_models["llama"], "--api-key-file", _key_file(tmp_path, 0o644))


# ---------------------------------------------------------------- the door


def test_api_key_on_every_route_but_health(server):
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
        ("GET", "/metrics", None),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/no/such/route", None),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, body in routes:
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            assert r.status_code == 401 and is_error(r), (path, headers, r.status_code)
    assert httpx.get(server.url + "/health").status_code == 200
    for method, path, body in routes[:-1]:
        r = httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, (path, r.text)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    address = f"ipc://{os.path.join(tempfile.gettempdir(), f'subway-{server.run_id}')}/client.sock"
    with Client(address) as c, pytest.raises(RequestError) as e:
        c.generate("x", max_tokens=2)
    assert e.value.status == 401
    with Client(address, api_key=KEY) as c:
        assert c.generate("x", max_tokens=2).finish_reason is not None


def test_binds_to_loopback_by_default(server):
    assert EngineConfig.build().server.host == "127.0.0.1"
    frontend = server.child("frontend")
    listening = [c for c in frontend.net_connections(kind="tcp") if c.status == "LISTEN"]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)


def test_body_and_header_limits(http):
    big = {"model": MODEL, "prompt": "a" * (9 * 1024 * 1024)}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and is_error(r)
    r = http.get("/v1/models", headers={"X-Padding": "p" * 20_000})
    assert r.status_code == 431 and is_error(r)
    assert http.get("/v1/models").status_code == 200


# ---------------------------------------------------------------- load and time


def test_full_queue_is_429_with_retry_after(server, http):
    """--max-num-seqs 2 --max-waiting 2: two run, two wait, the fifth is refused.

    No holder may be refused: CI once saw the fourth refused, the scheduler having counted
    arrivals a plan had not weighed yet as its queue (`num_queued` since). The holders ask
    for as many tokens as the context allows; should a fast machine still finish the first
    two before the queue is seen full, that round is no verdict and runs again. A round in
    which none finished must end full and refuse the probes.
    """
    for _ in range(3):
        if _full_queue_round(server, http):
            break
    else:
        pytest.fail("in three rounds a holder always finished before the queue was seen full")
    assert idle_within(http, 5.0)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def _full_queue_round(server, http) -> bool:
    """Four holders, then the probes once two run and two wait. False if a holder finished
    (its stream ended) before the probes were done: the queue was not held full throughout."""
    body = {"model": MODEL, "prompt": "go " * 8, "max_tokens": CONTEXT - 64, "ignore_eos": True,
            "stream": True}  # fmt: skip
    stop = threading.Event()
    started: list[int] = []
    finished: list[float] = []

    def hold() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            started.append(r.status_code)
            if r.status_code != 200:
                return
            for _ in r.iter_lines():
                if stop.is_set():
                    return
            finished.append(time.monotonic())

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            m = metrics(http)
            if m["subway:num_requests_running"] == 2 and m["subway:num_requests_waiting"] == 2:
                break
            assert all(code == 200 for code in started), f"a holder was refused: {started}"
            if finished:
                return False
            seen = (m["subway:num_requests_running"], m["subway:num_requests_waiting"])
            assert time.monotonic() < deadline, f"running, waiting: {seen}; holders: {started}"
            time.sleep(0.05)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
        )
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            refused = None
        except openai.RateLimitError as e:
            refused = e
        if finished:
            return False
        assert r.status_code == 429 and is_error(r)
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["Retry-After"]) >= 1
        assert chat.status_code == 429
        assert refused is not None, "the openai client's request was served, not refused"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert started == [200] * 4
    return True


def test_request_timeout_and_disconnects_abort_in_the_scheduler(server, http):
    long = {"model": MODEL, "prompt": "tick " * 8, "max_tokens": 900, "ignore_eos": True}
    r = http.post("/v1/completions", json={**long, "timeout": 0.3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
    assert idle_within(http, 1.0)
    # Non-streaming: the client gives up (read timeout) and goes away.
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=0.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=long)
    assert idle_within(http, 1.0)
    # Streaming: the client reads a little, then closes.
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**long, "stream": True}, headers=AUTH
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    assert idle_within(http, 1.0)


# ---------------------------------------------------------------- bad input

CHAT = [{"role": "user", "content": "hi"}]
C, CH = "/v1/completions", "/v1/chat/completions"
BAD = [
    (C, b'{"prompt": "hi"', 400),
    (C, b"not json", 400),
    (C, b"[1, 2]", 400),
    (C, b'"just a string"', 400),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400),
    (C, b'{"prompt": "hi", "top_p": Infinity}', 400),
    (C, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400),
    (C, b'{"prompt": "hi", "temperature": 1e999}', 400),
    (C, b'{"prompt": "\\ud800"}', 400),
    (C, b"[" * 5000 + b"]" * 5000, 400),
    (C, {}, 400),
    (C, {"prompt": 5}, 400),
    (C, {"prompt": []}, 400),
    (C, {"prompt": [[]]}, 400),
    (C, {"prompt": ""}, 400),
    (C, {"prompt": [49152]}, 400),  # the vocabulary is [0, 49152)
    (C, {"prompt": [-1, 5]}, 400),
    (C, {"prompt": [[1, 2], [10**12]]}, 400),
    (C, {"prompt": list(range(100, 100 + CONTEXT))}, 400),
    (C, {"prompt": "hi", "max_tokens": 0}, 400),
    (C, {"prompt": "hi", "max_tokens": -1}, 400),
    (C, {"prompt": "hi", "max_tokens": "many"}, 400),
    (C, {"prompt": "hi", "max_tokens": CONTEXT}, 400),
    (C, {"prompt": "hi", "max_tokens": 10**30}, 400),
    (C, {"prompt": "hi", "temperature": -0.1}, 400),
    (C, {"prompt": "hi", "top_p": 0}, 400),
    (C, {"prompt": "hi", "top_p": 1.01}, 400),
    (C, {"prompt": "hi", "top_k": -2}, 400),
    (C, {"prompt": "hi", "min_p": 1.5}, 400),
    (C, {"prompt": "hi", "presence_penalty": 3}, 400),
    (C, {"prompt": "hi", "frequency_penalty": -2.5}, 400),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400),
    (C, {"prompt": "hi", "seed": 2**64}, 400),
    (C, {"prompt": "hi", "seed": 1.5}, 400),
    (C, {"prompt": "hi", "n": 0}, 400),
    (C, {"prompt": "hi", "n": 10_000}, 400),
    (C, {"prompt": "hi", "logprobs": 21}, 400),
    (C, {"prompt": "hi", "logprobs": -1}, 400),
    (C, {"prompt": "hi", "stop": 5}, 400),
    (C, {"prompt": "hi", "stop": ["a"] * 100}, 400),
    (C, {"prompt": "hi", "stop_token_ids": [10**9]}, 400),
    (C, {"prompt": "hi", "stop_token_ids": [-3]}, 400),
    (C, {"prompt": "hi", "stream": "maybe"}, 400),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    (C, {"prompt": "hi", "logit_bias": {"five": 10}}, 400),
    (C, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400),
    (C, {"prompt": "hi", "logit_bias": {"49152": 10}}, 400),
    (C, {"prompt": "hi", "suffix": "tail"}, 400),
    (C, {"prompt": "hi", "best_of": 1, "n": 2}, 400),
    (C, {"prompt": "hi", "best_of": 3, "stream": True}, 400),
    (C, {"prompt": "hi", "best_of": 100}, 400),
    (C, {"prompt": "hi", "min_tokens": 17}, 400),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "(open"}}, 400),
    (C, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400),
    (C, {"prompt": "hi", "priority": 2**40}, 400),
    (C, {"prompt": "hi", "timeout": -1}, 400),
    (C, {"prompt": "hi", "slo_class": "urgent"}, 400),
    (C, {"prompt": "hi", "model": "gpt-17"}, 404),
    (CH, {}, 400),
    (CH, {"messages": []}, 400),
    (CH, {"messages": "hi"}, 400),
    (CH, {"messages": [{"content": "no role"}]}, 400),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CH, {"messages": [{"role": "user", "content": 42}]}, 400),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CH, {"messages": [{"role": "user", "content": "word " * (CONTEXT + 10)}]}, 400),
    (CH, {"messages": CHAT, "max_completion_tokens": 0}, 400),
    (CH, {"messages": CHAT, "max_tokens": CONTEXT}, 400),
    (CH, {"messages": CHAT, "top_logprobs": 3}, 400),
    (CH, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    (CH, {"messages": CHAT, "temperature": "hot"}, 400),
    (CH, {"messages": CHAT, "continue_final_message": True}, 400),
    (CH, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400),
    (CH, {"messages": CHAT, "model": "gpt-17"}, 404),
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400),
    ("/detokenize", {"tokens": [49152]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/v1/models", {"prompt": "x"}, 405),
    ("/v1/nothing", {"prompt": "x"}, 404),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(http, server):
    assert len(BAD) >= 30
    for path, body, status in BAD:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, (path, str(body)[:80], r.status_code, r.text[:200])
        assert is_error(r), (path, str(body)[:80], r.text[:200])
        assert r.json()["error"]["code"] == status
    # Still serving, with the same process.
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "still alive", "max_tokens": 3}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert server.proc.poll() is None
    assert "Traceback" not in server.read_output()
