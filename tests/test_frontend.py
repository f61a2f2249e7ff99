"""A live frontend (`python -m subway.frontend`) against a fake scheduler thread.

The fake scheduler speaks the real contract over the real sockets: it answers
FrontendHello with EngineReady (once `ready_gate` is set), and each AddRequest
by streaming back the prompt's ids (then EOS unless the prompt fills
max_tokens; with ignore_eos it cycles the prompt up to max_tokens), `chunk`
tokens per Deltas every `token_delay` seconds. It records every AddRequest
(with its prompt ids) and every AbortRequest, sends a heartbeat (an empty
Deltas with stats) every 0.3 s unless `paused`, and sends EngineError or
EngineReady on demand. zmq sockets are not thread-safe: everything that
touches them runs in the fake's own thread.

The HTTP tests share one frontend process (module scope); each leaves it
serving and the fake's knobs as it found them, so that they pass in any order.
The test that stops a frontend starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import httpx
import numpy as np
import openai
import pytest
import zmq

from subway.frontend.engine_client import EngineClient, EngineDeadError, QueueFullError
from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AbortRequest,
    AddLora,
    AddRequest,
    Codec,
    Deltas,
    EngineError,
    EngineReady,
    EngineStats,
    FrontendHello,
    Grammar,
    RemoveLora,
    RequestDelta,
    SamplingParams,
    ToFrontend,
    ToScheduler,
)
from subway.ipc.shm import TokenBuffer
from subway.ipc.sockets import bind, cleanup_ipc, connect
from subway.tools.serve_process import free_port as _free_port  # test_front_door's name

EOS = 2
MODEL = "smol-test"


@dataclass
class _Live:
    add: AddRequest
    output: list[int]
    finish: str
    sent: int = 0
    next_at: float = 0.0


@dataclass
class FakeScheduler:
    config: EngineConfig
    vocab_size: int = 49152
    max_model_len: int = 256
    owner_in_process: bool = False  # the shm owner is this process: attach without unregistering
    chunk: int = 4
    token_delay: float = 0.0
    paused: bool = False
    adds: list[AddRequest] = field(default_factory=list)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
    loras: list[AddLora | RemoveLora] = field(default_factory=list)
    hellos: int = 0
    ready_gate: threading.Event = field(default_factory=threading.Event)
    hold_aborts: bool = False  # answer aborts only when this turns False again

    def __post_init__(self) -> None:
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-scheduler")
        self._shm = None
        self._array = None
        self.prompt_shm = self.config.ipc.prompt_shm_name  # as the frontend's hello names it

    # ------------------------------------------------ test side

    def start(self) -> FakeScheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def send_error(self, message: str) -> None:
        self._commands.put(EngineError(message=message))

    def send_ready(self) -> None:
        self._commands.put("ready")

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    # ------------------------------------------------ scheduler side

    def _ready_msg(self) -> EngineReady:
        return EngineReady(
            num_blocks=1000,
            block_size=16,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=[EOS],
        )

    def _prompt(self, add: AddRequest) -> list[int]:
        ref = add.prompt
        if ref.ids is not None:
            return list(ref.ids)
        if self._array is None:
            name = self.prompt_shm
            if self.owner_in_process:
                self._shm = shared_memory.SharedMemory(name=name)
                self._array = np.ndarray((self._shm.size // 4,), np.int32, buffer=self._shm.buf)
            else:
                self._shm = TokenBuffer.attach(name)
                self._array = self._shm.array
        return self._array[ref.offset : ref.offset + ref.length].tolist()

    def _plan(self, add: AddRequest) -> _Live:
        prompt = self._prompt(add)
        self.prompts[add.request_id] = prompt
        n = add.sampling.max_tokens
        if add.sampling.ignore_eos:
            output = [prompt[i % len(prompt)] for i in range(n)]
            return _Live(add, output, "length")
        if len(prompt) < n:
            return _Live(add, prompt + [EOS], "stop")
        return _Live(add, prompt[:n], "length")

    def _delta(self, live: _Live) -> RequestDelta:
        ids = live.output[live.sent : live.sent + self.chunk]
        first = live.sent == 0
        live.sent += len(ids)
        done = live.sent >= len(live.output)
        delta = RequestDelta(
            request_id=live.add.request_id,
            token_ids=ids,
            finish_reason=live.finish if done else None,
            num_prompt_tokens=live.add.prompt_len if first else 0,
        )
        k = live.add.sampling.logprobs
        if k is not None:
            delta.logprobs = [-0.25] * len(ids)
            delta.top_ids = [[t, (t + 1) % self.vocab_size][:k] for t in ids]
            delta.top_logprobs = [[-0.25, -3.0][:k] for _ in ids]
        return delta

    def _run(self) -> None:
        ctx = zmq.Context()
        pull = bind(ctx, zmq.PULL, self.config.ipc.scheduler_addr)
        push = connect(ctx, zmq.PUSH, self.config.ipc.frontend_addr)
        codec_in, codec_out = Codec(ToScheduler), Codec(ToFrontend)
        live: dict[str, _Live] = {}
        held: list[str] = []  # aborts not yet answered
        ready = False
        last_beat = 0.0
        try:
            while not self._stop.is_set():
                if not ready and self.hellos and self.ready_gate.is_set():
                    push.send(codec_out.encode(self._ready_msg()))
                    ready = True
                while not self._commands.empty():
                    cmd = self._commands.get()
                    if cmd == "ready":
                        push.send(codec_out.encode(self._ready_msg()))
                    else:
                        live.clear()
                        push.send(codec_out.encode(cmd))
                if pull.poll(5):
                    while pull.poll(0):
                        msg = codec_in.decode(pull.recv())
                        if isinstance(msg, FrontendHello):
                            self.hellos += 1
                            self.prompt_shm = msg.prompt_shm
                        elif isinstance(msg, AddRequest):
                            self.adds.append(msg)
                            live[msg.request_id] = self._plan(msg)
                        elif isinstance(msg, AbortRequest):
                            self.aborts.append(msg.request_id)
                            live.pop(msg.request_id, None)  # an "abort" delta either way
                            held.append(msg.request_id)
                        elif isinstance(msg, (AddLora, RemoveLora)):
                            self.loras.append(msg)
                if held and not self.hold_aborts:
                    acks = [RequestDelta(rid, [], "abort") for rid in held]
                    held.clear()
                    push.send(codec_out.encode(Deltas(acks)))
                now = time.monotonic()
                if self.paused:
                    continue
                deltas = []
                for rid, item in list(live.items()):
                    if now >= item.next_at:
                        deltas.append(self._delta(item))
                        item.next_at = now + self.token_delay
                        if item.sent >= len(item.output):
                            del live[rid]
                if deltas:
                    push.send(codec_out.encode(Deltas(deltas, EngineStats(num_running=len(live)))))
                    last_beat = now
                elif ready and now - last_beat > 0.3:
                    push.send(codec_out.encode(Deltas([], EngineStats())))
                    last_beat = now
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()
            cleanup_ipc(self.config.ipc.scheduler_addr)
            if self._shm is not None:
                self._array = None
                self._shm.close()


# ---------------------------------------------------------------- the live frontend


@dataclass
class Frontend:
    config: EngineConfig
    proc: subprocess.Popen
    fake: FakeScheduler
    url: str
    tokenizer: object
    log_path: str
    health_before_ready: int = 0

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 20.0), **kw)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@contextlib.contextmanager
def _live_frontend(default_model: str, tokenizer, run_dir, **flags) -> Iterator[Frontend]:
    """`python -m subway.frontend` in a subprocess, with a fake scheduler thread here;
    stopped (if it still runs) on leaving. `flags`: more of the config's fields."""
    port = _free_port()
    config = EngineConfig.build(
        path=default_model,
        served_model_name=MODEL,
        run_dir=str(run_dir),
        port=port,
        shutdown_timeout=1.0,
        **flags,
    )
    log_path = str(run_dir / "frontend.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "subway.frontend", "--config-json", config.to_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fake = FakeScheduler(config, vocab_size=len(tokenizer)).start()
    fe = Frontend(config, proc, fake, f"http://127.0.0.1:{port}", tokenizer, log_path)
    try:
        with fe.client(timeout=2.0) as c:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, open(log_path).read()
                try:
                    fe.health_before_ready = c.get("/health").status_code
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the frontend did not come up"
                    time.sleep(0.2)  # a bounded wait for the port to open, as in serving.py
            fake.ready_gate.set()
            assert fake.wait_for(lambda: c.get("/health").status_code == 200, 10)
        yield fe
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        fake.stop()


@pytest.fixture(scope="module")
def frontend(default_model, tokenizer, tmp_path_factory):
    """One live frontend shared by the module's HTTP tests: each leaves it serving, with
    the fake scheduler's knobs as it found them."""
    with _live_frontend(default_model, tokenizer, tmp_path_factory.mktemp("run")) as fe:
        yield fe


@pytest.fixture
def own_frontend(default_model, tokenizer, tmp_path_factory):
    """A live frontend of the test's own, for a test that stops it."""
    with _live_frontend(default_model, tokenizer, tmp_path_factory.mktemp("run")) as fe:
        yield fe


def _sse(lines) -> list:
    """Parse an SSE body: the JSON events, then "[DONE]" if it came."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


def _is_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- tests


def test_health_before_and_after_ready_and_models(frontend):
    assert frontend.health_before_ready == 503
    assert frontend.fake.hellos == 1
    with frontend.client() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_metrics(frontend):
    with frontend.client() as c:
        c.post("/v1/completions", json={"prompt": "count me"})
        text = c.get("/metrics").text
    assert "subway:num_requests_running" in text
    assert 'subway:request_success_total{finished_reason="stop",model_name="smol-test"}' in text


def _rejected(c: httpx.Client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == "subway:ipc_rejected_messages_total":
                return s.value
    raise AssertionError("no subway:ipc_rejected_messages_total")


def test_refused_messages_are_counted_in_metrics(frontend):
    """Garbage on the scheduler link and at the native ZMQ endpoint: refused, counted in
    subway:ipc_rejected_messages_total, and the frontend serves on."""
    ctx = zmq.Context()
    try:
        with frontend.client() as c:
            before = _rejected(c)
            link = connect(ctx, zmq.PUSH, frontend.config.ipc.frontend_addr)
            link.send(b"\xc1 not a message")
            dealer = connect(ctx, zmq.DEALER, frontend.config.client_address)
            dealer.send_multipart([b"just one frame"])
            assert dealer.poll(10_000), "the endpoint answered nothing"
            dealer.recv_multipart()  # an error answer, not silence
            assert frontend.fake.wait_for(lambda: _rejected(c) >= before + 2, 10)
            assert c.post("/v1/completions", json={"prompt": "still here"}).status_code == 200
        link.close(0)
        dealer.close(0)
    finally:
        ctx.term()


def test_completion_non_streaming(frontend):
    ids = _ids(frontend.tokenizer, "Hello world")
    with frontend.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert body["model"] == MODEL and isinstance(body["created"], int)
        [choice] = body["choices"]
        assert choice == {
            "index": 0,
            "text": "Hello world",
            "logprobs": None,
            "finish_reason": "stop",
        }
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(ids) + 1,
            "total_tokens": 2 * len(ids) + 1,
        }
        add = frontend.fake.adds[-1]
        assert add.request_id == body["id"] + "-0"
        assert add.sampling.max_tokens == 16  # the completions default
        # max_tokens cuts the output: finish_reason "length".
        r = c.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 1})
        [choice] = r.json()["choices"]
        assert choice["text"] == "Hello" and choice["finish_reason"] == "length"


def test_completion_streaming(frontend):
    with frontend.client() as c:
        body = {
            "prompt": "Streaming is fun",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "text_completion" for e in chunks)
    assert len({e["id"] for e in chunks}) == 1
    text = "".join(ch["text"] for e in chunks for ch in e["choices"])
    assert text == "Streaming is fun"
    finishes = [ch["finish_reason"] for e in chunks for ch in e["choices"] if ch["finish_reason"]]
    assert finishes == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_completion_token_ids_batches_echo_n_and_logprobs(frontend):
    tok = frontend.tokenizer
    a, b = _ids(tok, "one two"), _ids(tok, "three")
    with frontend.client() as c:
        r = c.post(
            "/v1/completions", json={"prompt": [a, b], "n": 2, "max_tokens": 5, "echo": True}
        )
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
        texts = [ch["text"] for ch in body["choices"]]
        assert texts == ["one two" * 2] * 2 + ["three" * 2] * 2
        assert body["usage"]["prompt_tokens"] == len(a) + len(b)
        rids = {x.request_id for x in frontend.fake.adds[-4:]}
        assert rids == {f"{body['id']}-{i}" for i in range(4)}  # one engine request per choice
        r = c.post("/v1/completions", json={"prompt": a, "logprobs": 2, "max_tokens": 3})
        [choice] = r.json()["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
        assert lp["token_logprobs"] == [-0.25] * 3 and len(lp["top_logprobs"][0]) == 2
        assert lp["text_offset"][0] == 0


def test_stop_strings(frontend):
    with frontend.client() as c:
        r = c.post(
            "/v1/completions", json={"prompt": "The quick brown fox", "stop": [" brown", "zzz"]}
        )
        [choice] = r.json()["choices"]
        assert choice["text"] == "The quick" and choice["finish_reason"] == "stop"
        rid = r.json()["id"] + "-0"  # the engine request still ran: the frontend aborts it
        assert frontend.fake.wait_for(lambda: rid in frontend.fake.aborts)
        body = {"prompt": "The quick brown fox", "stop": "ick b", "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = _sse(r.iter_lines())
    pieces = [ch["text"] for e in events[:-1] for ch in e["choices"]]
    assert "".join(pieces) == "The qu" and not any("ick" in p for p in pieces)


def test_chat_with_openai_client(frontend):
    tok = frontend.tokenizer
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids, skip_special_tokens=True)
    client = frontend.openai()
    out = client.chat.completions.create(model=MODEL, messages=messages)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ids) + 1
    assert frontend.fake.prompts[out.id + "-0"] == ids
    # The chat default max_tokens is the rest of the context.
    assert frontend.fake.adds[-1].sampling.max_tokens == 256 - len(ids)

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        stream=True,
        max_completion_tokens=8,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    prompt = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "Hi\nthere"}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )
    assert content == tok.decode(prompt[:8], skip_special_tokens=True)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_with_openai_client(frontend):
    client = frontend.openai()
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, n=2)
    assert [c.text for c in out.choices] == ["Hello world"] * 2
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="Hello world", stream=True)
    ]
    assert "".join(pieces) == "Hello world"
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 1


def test_wrong_model_is_404(frontend):
    with frontend.client() as c:
        r = c.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"})
        assert r.status_code == 404 and _is_error(r.json())
        r = c.post(
            "/v1/chat/completions",
            json={"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 404 and _is_error(r.json())
    with pytest.raises(openai.NotFoundError):
        frontend.openai().completions.create(model="gpt-17", prompt="hi")


LONG = list(range(100, 400))  # 300 ids: beyond the fake's 256-token context
CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi"'),
    ("/v1/completions", b"not json at all"),
    ("/v1/completions", b"[1, 2, 3]"),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}'),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": [-1, 5]}),
    ("/v1/completions", {"prompt": LONG}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "stop": 5}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}),
    ("/v1/completions", {"prompt": "hi", "slo_class": "urgent"}),
    ("/v1/completions", {"prompt": "hi", "stream": "maybe"}),
    # Strict JSON types: a truthy string is no boolean, a numeral string no number.
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
    ("/v1/completions", {"prompt": "hi", "stream": 1}),
    ("/v1/completions", {"prompt": "hi", "echo": "true"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": "true"}),
    # A chat template is code: not from a request, unless the server trusts requests.
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50, "logprobs": True}),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(frontend):
    with frontend.client() as c:
        for path, body in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert _is_error(r.json()), r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/completions", json={"prompt": "still alive"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "still alive"
    assert frontend.proc.poll() is None


def _slow(fake: FakeScheduler):
    fake.chunk, fake.token_delay = 1, 0.05


def _fast(fake: FakeScheduler):
    fake.chunk, fake.token_delay = 4, 0.0


def test_streaming_client_disconnect_aborts(frontend):
    fake = frontend.fake
    _slow(fake)
    try:
        body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with frontend.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            rid = json.loads(first[len("data: ") :])["id"] + "-0"
        assert fake.wait_for(lambda: rid in fake.aborts), "no AbortRequest after the disconnect"
    finally:
        _fast(fake)


def test_non_streaming_client_disconnect_aborts(frontend):
    fake = frontend.fake
    _slow(fake)
    try:
        n_adds = len(fake.adds)
        body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True}
        with frontend.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
        assert fake.wait_for(lambda: len(fake.adds) > n_adds)
        rid = fake.adds[n_adds].request_id
        assert fake.wait_for(lambda: rid in fake.aborts), "no AbortRequest after the disconnect"
    finally:
        _fast(fake)


def test_engine_failure_mid_request_then_recovery(frontend):
    fake = frontend.fake
    _slow(fake)
    slow = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True}
    try:
        with frontend.client() as c, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                lambda: c.post("/v1/chat/completions", json={"messages": CHAT, **slow})
            )
            with c.stream("POST", "/v1/completions", json={**slow, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                fake.send_error("worker 0 died")
                events = _sse(lines)
            assert events[-1] == "[DONE]" and _is_error(events[-2])
            r = pending.result(timeout=10)
            assert r.status_code == 503 and _is_error(r.json())
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
            fake.send_ready()
            assert fake.wait_for(lambda: c.get("/health").status_code == 200)
            _fast(fake)
            assert (
                c.post("/v1/completions", json={"prompt": "hi"}).json()["choices"][0]["text"]
                == "hi"
            )
    finally:
        _fast(fake)


def test_health_and_errors_show_no_traceback_or_path(frontend):
    """An engine error with a traceback and file paths: /health and the error bodies give
    its first line, paths masked; the frontend's log keeps the rest."""
    fake = frontend.fake
    leak = (
        "worker 0: FileNotFoundError: [Errno 2] No such file: '/srv/secret/weights.bin'\n"
        "Traceback (most recent call last):\n"
        '  File "/work/main/worker/runner.py", line 212, in execute'
    )
    with frontend.client() as c:
        try:
            fake.send_error(leak)
            assert fake.wait_for(lambda: c.get("/health").status_code == 503)
            bodies = [c.get("/health").text, c.post("/v1/completions", json={"prompt": "hi"}).text]
            for text in bodies:
                assert "FileNotFoundError" in text, text
                assert "Traceback" not in text and "/srv/" not in text and "/work/" not in text
        finally:
            fake.send_ready()
            assert fake.wait_for(lambda: c.get("/health").status_code == 200)


def test_health_fails_when_the_scheduler_goes_silent(frontend):
    fake = frontend.fake
    with frontend.client() as c:
        fake.paused = True
        try:
            assert fake.wait_for(lambda: c.get("/health").status_code == 503, timeout=6)
        finally:
            fake.paused = False
        assert fake.wait_for(lambda: c.get("/health").status_code == 200)


def test_client_priority_is_ignored_unless_the_server_allows_it(frontend):
    """A request's priority and SLO fields reach the scheduler only with
    --allow-client-priority; otherwise they are dropped, and a header says which."""
    fake = frontend.fake
    with frontend.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "priority": -5, "slo_class": "batch"})
        assert r.status_code == 200
        assert r.headers["x-subway-ignored-fields"] == "priority, slo_class"
        rid = r.json()["id"] + "-0"  # its one choice's engine request
        (add,) = [a for a in fake.adds if a.request_id == rid]
        assert (add.priority, add.slo_class, add.slo_ttft_ms) == (0, "interactive", None)
        plain = c.post("/v1/completions", json={"prompt": "hi"})
        assert "x-subway-ignored-fields" not in plain.headers


def test_sampling_fields_reach_the_engine_and_bad_grammars_do_not(frontend):
    """logit_bias, min_tokens and the output's grammar go into the request's
    SamplingParams; a grammar that does not compile is a 400 that sends nothing."""
    fake = frontend.fake
    with frontend.client() as c:
        body = {"prompt": "hi", "logit_bias": {"17": -100, "4": 2.5}, "min_tokens": 3}
        r = c.post("/v1/completions", json=body | {"structured_outputs": {"regex": "[0-9]+"}})
        assert r.status_code == 200, r.text
        (add,) = [a for a in fake.adds if a.request_id == r.json()["id"] + "-0"]
        sp = add.sampling
        assert sp.logit_bias == {17: -100.0, 4: 2.5} and sp.min_tokens == 3
        assert sp.grammar == Grammar("regex", "[0-9]+")
        chat = {"messages": CHAT, "response_format": {"type": "json_object"}}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and fake.adds[-1].sampling.grammar == Grammar("json_object")
        r = c.post("/v1/chat/completions", json={"messages": CHAT})
        assert fake.adds[-1].sampling.grammar is None
        sent = len(fake.adds)
        for bad in (
            {"structured_outputs": {"regex": "(x"}},
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            {"guided_grammar": "root ::= missing"},
            {"logit_bias": {str(fake.vocab_size): 1}},
            {"min_tokens": 17},  # above the default max_tokens of 16
        ):
            r = c.post("/v1/completions", json={"prompt": "hi", **bad})
            assert r.status_code == 400 and _is_error(r.json()), (bad, r.text)
        assert len(fake.adds) == sent


def test_stop_string_kept_and_min_tokens(frontend):
    """The fake echoes the prompt: 'a, b, c, d' with the stop ','."""
    tok = frontend.tokenizer
    prompt = "a, b, c, d"
    ids = _ids(tok, prompt)
    first = next(k for k in range(len(ids) + 1) if "," in tok.decode(ids[:k]))
    with frontend.client() as c:

        def text(stream: bool, **kw) -> str:
            body = {"prompt": prompt, "stop": [","], "stream": stream, **kw}
            if not stream:
                return c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            with c.stream("POST", "/v1/completions", json=body) as r:
                events = _sse(r.iter_lines())
            return "".join(ch["text"] for e in events[:-1] for ch in e["choices"])

        for stream in (False, True):
            assert text(stream) == "a"
            assert text(stream, include_stop_str_in_output=True) == "a,"
            assert text(stream, min_tokens=first) == "a, b"
            assert text(stream, min_tokens=first, include_stop_str_in_output=True) == "a, b,"


def test_special_tokens_shown_unless_skipped(frontend):
    with frontend.client() as c:
        prompt = "<|im_start|>hi<|im_end|>"
        shown = c.post("/v1/completions", json={"prompt": prompt, "skip_special_tokens": False})
        skipped = c.post("/v1/completions", json={"prompt": prompt})
    assert shown.json()["choices"][0]["text"] == "<|im_start|>hi<|im_end|>"
    assert skipped.json()["choices"][0]["text"] == "hi"


def test_best_of_runs_more_and_returns_n(frontend):
    fake = frontend.fake
    with frontend.client() as c:
        r = c.post("/v1/completions", json={"prompt": "one two", "best_of": 3, "max_tokens": 2})
        body = r.json()
        assert r.status_code == 200 and len(body["choices"]) == 1
        assert body["choices"][0]["logprobs"] is None and body["choices"][0]["text"] == "one two"
        adds = [a for a in fake.adds if a.request_id.startswith(body["id"] + "-")]
        assert len(adds) == 3 and all(a.sampling.logprobs == 0 for a in adds)
        assert body["usage"]["completion_tokens"] == 2  # the returned choice's
        for bad in ({"best_of": 1, "n": 2}, {"best_of": 2, "stream": True}):
            r = c.post("/v1/completions", json={"prompt": "x", **bad})
            assert r.status_code == 400, bad


def test_prompts_travel_through_shm_and_shutdown_cleans_up(own_frontend):
    """Every kind of prompt reaches the scheduler through the shm ring; SIGTERM cleans up.
    It stops its frontend: a frontend of its own, not the module's."""
    frontend = own_frontend
    tok = frontend.tokenizer
    with frontend.client() as c:
        for path, body in (
            ("/v1/completions", {"prompt": "Hello world"}),
            ("/v1/completions", {"prompt": [_ids(tok, "one two"), _ids(tok, "three")], "n": 2}),
            ("/v1/completions", {"prompt": "Streaming is fun", "stream": True}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            assert c.post(path, json=body).status_code == 200, (path, body)
    refs = [a.prompt for a in frontend.fake.adds]
    assert len(refs) == 7 and all(r.ids is None and r.offset >= 0 for r in refs)
    prefix = f"subway_{frontend.config.ipc.run_id}"
    assert any(name.startswith(prefix) for name in os.listdir("/dev/shm"))
    # SIGTERM with a stream in flight: the drain times out, the stream is cut and aborted.
    fake = frontend.fake
    _slow(fake)
    n_adds = len(fake.adds)
    body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}

    def consume() -> None:
        with contextlib.suppress(httpx.HTTPError), frontend.client() as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(consume)
        assert fake.wait_for(lambda: len(fake.adds) > n_adds)
        frontend.proc.send_signal(signal.SIGTERM)
        assert frontend.proc.wait(20) == 0, open(frontend.log_path).read()
        streaming.result(timeout=10)
    _fast(fake)
    assert fake.wait_for(lambda: fake.adds[n_adds].request_id in fake.aborts)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert not os.path.exists(frontend.config.ipc.frontend_addr[len("ipc://") :])


# ---------------------------------------------------------------- the engine client alone


async def _ready_client(config: EngineConfig) -> EngineClient:
    """A started EngineClient, once the fake scheduler has said it is ready (within 4 s)."""
    client = EngineClient(config)
    await client.start()
    deadline = time.monotonic() + 4.0
    while not client.link.ready:
        if time.monotonic() > deadline:
            await client.aclose()
            raise AssertionError("the fake scheduler did not say ready within 4 s")
        await asyncio.sleep(0.02)  # paces the poll; the loop reads the link meanwhile
    return client


def test_the_link_reads_a_burst_past_its_batch_garbage_and_a_failing_handler(tmp_path):
    """The scheduler link reads its PULL socket from the loop's own reader, at most
    READ_BATCH messages a turn: a burst of three batches' worth arrives whole and in order,
    an undecodable message is refused and counted, and a message whose handling raises
    leaves the rest to be read."""
    from subway.frontend.scheduler_link import SchedulerLink

    config = EngineConfig.build(run_dir=str(tmp_path))
    got: list[str] = []

    def on_deltas(deltas: list[RequestDelta]) -> None:
        if deltas[0].request_id == "boom":
            raise RuntimeError("a handler's bug")
        got.extend(d.request_id for d in deltas)

    async def main() -> None:
        link = SchedulerLink(config, on_deltas, lambda e: None)
        link.start()
        ctx = zmq.Context()
        push = connect(ctx, zmq.PUSH, config.ipc.frontend_addr)
        try:
            n = 3 * link.READ_BATCH
            codec = Codec(ToFrontend)
            for i in range(n):
                if i == 10:
                    push.send(b"\xc1 not a message")
                if i == 20:
                    push.send(codec.encode(Deltas([RequestDelta("boom", [1])])))
                push.send(codec.encode(Deltas([RequestDelta(f"r{i}", [i])])))
            for _ in range(500):
                if len(got) == n:
                    break
                await asyncio.sleep(0.01)
            assert got == [f"r{i}" for i in range(n)]
            assert link.rejected == 1
        finally:
            push.close(0)
            ctx.term()
            await link.stop_tasks()
            link.close()

    asyncio.run(main())


def test_admission_counts_the_queue_a_plan_passed_over_not_fresh_arrivals():
    """The 429 bound weighs the scheduler's `num_queued`. Its `num_waiting` also holds
    arrivals that came while a plan was in flight; counting those refused a request that
    a free seat would have taken (CI saw the fourth of four refused at 2 seats, 2 waiting)."""
    client = EngineClient(EngineConfig.build(max_num_seqs=2, max_waiting=2))
    try:
        client.link.stats = EngineStats(num_running=1, num_waiting=2, num_queued=0)
        assert client.waiting_with(1) == 0
        client.check_capacity(1)
        client.link.stats = EngineStats(num_running=2, num_waiting=2, num_queued=2)
        assert client.waiting_with(1) == 3
        with pytest.raises(QueueFullError):
            client.check_capacity(1)
    finally:
        client.close()


def test_one_engine_and_a_group_are_both_the_engine_the_frontend_uses():
    """`Engine` declares all the frontend asks of an engine: `EngineClient` and `EngineGroup`
    both satisfy it, and a class missing a member does not."""
    from subway.frontend.engine import Engine, EngineLink
    from subway.frontend.engine_group import EngineGroup

    one = EngineClient(EngineConfig.build())
    group = EngineGroup(EngineConfig.build(data_parallel_size=2))
    try:
        for engine in (one, group):
            assert isinstance(engine, Engine) and isinstance(engine.link, EngineLink)
        assert not isinstance(object(), Engine)
    finally:
        one.close()
        group.close()


def test_engine_client_inline_fallback_abort_and_close(tmp_path):
    config = EngineConfig.build(run_dir=str(tmp_path), prompt_shm_tokens=16)
    fake = FakeScheduler(config, owner_in_process=True)
    fake.ready_gate.set()
    fake.start()

    async def main() -> None:
        client = await _ready_client(config)
        try:
            link = client.link
            assert link.ready and link.healthy and link.info.max_model_len == 256
            sp = SamplingParams(max_tokens=30)
            big = list(range(10, 30))  # 20 ids: more than the buffer holds
            got = [d async for d in client.generate("big", big, sp)]
            assert sum((d.token_ids for d in got), []) == big + [EOS]
            small = [5, 6, 7, 8]
            got = [d async for d in client.generate("small", small, sp)]
            assert got[-1].finish_reason == "stop"
            # Leaving early aborts.
            fake.chunk, fake.token_delay = 1, 0.05
            stream = client.generate(
                "early", small, SamplingParams(max_tokens=100, ignore_eos=True)
            )
            async with contextlib.aclosing(stream) as deltas:
                async for _ in deltas:
                    break
            assert client.num_in_flight == 0
            # An engine error fails what is in flight.
            stream = client.generate(
                "doomed", small, SamplingParams(max_tokens=100, ignore_eos=True)
            )
            await anext(stream)
            fake.send_error("boom")
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert not client.link.ready
        finally:
            await client.aclose()

    try:
        asyncio.run(main())
        assert fake.adds[0].prompt.ids == list(range(10, 30))
        assert fake.adds[1].prompt.ids is None and fake.adds[1].prompt.length == 4
        assert fake.wait_for(lambda: "early" in fake.aborts)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(config.ipc.prompt_shm_name)]
    finally:
        fake.stop()


def test_an_aborted_prompt_run_is_kept_until_the_scheduler_lets_go(tmp_path):
    """A plan that reads an aborted request's prompt may still be on its way to the workers:
    its run in the ring must not be handed out again before the scheduler's "abort" delta."""
    config = EngineConfig.build(run_dir=str(tmp_path), prompt_shm_tokens=64)
    fake = FakeScheduler(config, owner_in_process=True)
    fake.ready_gate.set()
    fake.start()

    async def main() -> None:
        client = await _ready_client(config)
        try:
            fake.paused, fake.hold_aborts = True, True
            slow = SamplingParams(max_tokens=100, ignore_eos=True)
            client.submit("victim", list(range(1, 21)), slow).close()  # aborted at once
            ring = client.ring
            victim = ring.runs["victim"]
            assert fake.wait_for(lambda: "victim" in fake.aborts)
            for i in range(6):  # more than the ring holds: they must go around the run
                client.submit(f"later{i}", [7] * 20, slow)
            taken = [ring.runs[r] for r in ring.runs if r != "victim"]
            assert ring.runs["victim"] == victim
            assert all(off + 20 <= victim or off >= victim + 20 for off in taken), taken
            fake.hold_aborts = False  # the scheduler lets go
            for _ in range(200):
                if "victim" not in ring.runs:
                    break
                await asyncio.sleep(0.02)
            assert "victim" not in ring.runs
        finally:
            await client.aclose()

    try:
        asyncio.run(main())
    finally:
        fake.stop()


def test_a_trusting_server_renders_the_request_template(tokenizer):
    from subway.frontend.chat import chat_prompt
    from subway.frontend.errors import APIError
    from subway.frontend.inputs import Limits, check_request
    from subway.frontend.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(
        messages=CHAT, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    )
    with pytest.raises(APIError) as e:
        check_request(req, EngineConfig.build())
    assert e.value.status == 400 and "--trust-request-chat-template" in str(e.value)
    check_request(req, EngineConfig.build(trust_request_chat_template=True))
    assert chat_prompt(req, tokenizer, Limits(512, 100000)).text == "hi|"


def test_client_priority_is_kept_when_allowed():
    from subway.frontend.inputs import client_scheduling
    from subway.frontend.protocol import CompletionRequest

    req = CompletionRequest(prompt="hi", priority=3, slo_ttft_ms=50.0)
    kept, dropped = client_scheduling(req, EngineConfig.build(allow_client_priority=True))
    assert kept is req and dropped == []
    gone, dropped = client_scheduling(req, EngineConfig.build())
    assert (gone.priority, gone.slo_ttft_ms) == (0, None) and dropped == ["priority", "slo_ttft_ms"]


def test_the_frontend_loads_autotokenizers_choice_without_torch(default_model, tmp_path):
    """`load_tokenizer` returns what AutoTokenizer returns (class, ids, chat template), and in
    a fresh process it loads without importing torch; a folder naming no class transformers
    has goes to AutoTokenizer."""
    import shutil

    from transformers import AutoTokenizer

    from subway.frontend.server import load_tokenizer
    from subway.ipc.config import EngineConfig

    ours = load_tokenizer(EngineConfig.build(path=default_model))
    auto = AutoTokenizer.from_pretrained(default_model)
    assert type(ours) is type(auto)
    for text in ("Hello, world!", "  spaces\tand\nlines  ", "日本語 émoji 🚇", ""):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False
    )
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)

    code = (
        "import sys; from subway.frontend.server import load_tokenizer; "
        "from subway.ipc.config import EngineConfig; "
        f"load_tokenizer(EngineConfig.build(path={default_model!r})); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    odd = tmp_path / "odd"
    shutil.copytree(default_model, odd, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    cfg = json.loads((odd / "tokenizer_config.json").read_text())
    (odd / "tokenizer_config.json").write_text(
        json.dumps(cfg | {"tokenizer_class": "NoSuchTokenizer"})
    )
    fallback = load_tokenizer(EngineConfig.build(path=str(odd)))
    assert fallback("Hello")["input_ids"] == auto("Hello")["input_ids"]
