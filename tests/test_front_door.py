"""The front door under hostile clients: slow and surplus connections, slow templates,
amplification and queue bounds, oversize stop strings.

One live frontend (`python -m subway.frontend`) against the fake scheduler of
`test_frontend.py`, started with small limits so that each bound shows in a
second or two: headers within 2 s, a body within 2 s, 320 connections, a chat
template within 1.5 s, 2 sequences in a batch and 4 waiting, 3000 prompt tokens
queued, 8 sequences per request, 5 tokens for a chat that names no max_tokens.
Pausing the fake keeps every submitted request without a token: waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from test_frontend import FakeScheduler, _free_port

from subway.ipc.config import EngineConfig

MODEL = "door"
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
TEMPLATE_TIMEOUT = 1.5
MAX_CONNECTIONS = 320
CHAT = [{"role": "user", "content": "hi"}]
# 10^10 empty iterations (the sandbox caps one range at 10^5): minutes of Jinja.
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)


class Door:
    def __init__(self, url: str, port: int, fake: FakeScheduler) -> None:
        self.url, self.port, self.fake = url, port, fake

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=20)

    @contextlib.contextmanager
    def paused(self):
        """The fake sends nothing: every request submitted meanwhile keeps waiting."""
        self.fake.paused = True
        try:
            yield
        finally:
            self.fake.paused = False


@pytest.fixture(scope="module")
def door(default_model, tmp_path_factory):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(default_model))
    run_dir = tmp_path_factory.mktemp("door")
    port = _free_port()
    config = EngineConfig.build(
        path=default_model,
        served_model_name=MODEL,
        run_dir=str(run_dir),
        port=port,
        shutdown_timeout=1.0,
        max_num_seqs=2,
        max_waiting=4,
        max_queued_tokens=3000,
        max_seqs_per_request=8,
        default_max_tokens=5,
        header_timeout=HEADER_TIMEOUT,
        body_timeout=BODY_TIMEOUT,
        max_connections=MAX_CONNECTIONS,
        template_timeout=TEMPLATE_TIMEOUT,
        trust_request_chat_template=True,
    )
    log_path = run_dir / "frontend.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "subway.frontend", "--config-json", config.to_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fake = FakeScheduler(config, vocab_size=vocab, max_model_len=4096).start()
    fake.ready_gate.set()
    d = Door(f"http://127.0.0.1:{port}", port, fake)
    try:
        deadline = time.monotonic() + 90
        with d.client() as c:
            while True:
                assert proc.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if c.get("/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, "the frontend did not come up"
                time.sleep(0.1)
        yield d
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        fake.stop()


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    return err


# ---------------------------------------------------------------- slow and surplus clients


async def _health_latency(port: int) -> float:
    """A fresh connection's GET /health, connect to last header byte, in seconds."""
    start = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    elapsed = time.monotonic() - start
    w.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    return elapsed


async def _until_closed(
    r: asyncio.StreamReader,
    w: asyncio.StreamWriter,
    limit: float,
    trickle: bytes = b"",
    period: tuple[float, float] = (1.0, 2.0),
) -> bytes:
    """Send `trickle` a byte every `period` seconds until the server closes; what it sent.
    Raises TimeoutError if it has not closed within `limit` seconds."""  # fmt: skip
    got = b""
    deadline = time.monotonic() + limit
    i = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"still open after {limit} s")
        try:
            data = await asyncio.wait_for(r.read(4096), min(left, random.uniform(*period)))
        except TimeoutError:
            if i < len(trickle):
                w.write(trickle[i : i + 1])
                i += 1
            continue
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


def test_trickling_clients_do_not_delay_health_and_are_closed(door):
    """300 clients each send part of a request line and headers, then a byte every 1-2 s.
    /health stays fast meanwhile, and every one of them is closed by the header timeout."""
    n = 300

    async def main() -> None:
        async def trickler() -> float:
            # Timed from before the connect: the server's clock starts at its accept, which is
            # later, whereas this task may resume after open_connection well after it.
            opened = time.monotonic()
            r, w = await asyncio.open_connection("127.0.0.1", door.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            got = await _until_closed(r, w, HEADER_TIMEOUT + 4, b"X-Slow: " + b"a" * 64)
            w.close()
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:80]
            return time.monotonic() - opened

        tasks = [asyncio.create_task(trickler()) for _ in range(n)]
        await asyncio.sleep(0.3)  # let them connect (not synchronisation: probes follow)
        latencies = []
        probe_until = time.monotonic() + HEADER_TIMEOUT
        while time.monotonic() < probe_until:
            latencies.append(await _health_latency(door.port))
            await asyncio.sleep(0.1)
        lifetimes = await asyncio.gather(*tasks)
        assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
        assert max(lifetimes) < HEADER_TIMEOUT + 3, max(lifetimes)
        assert min(lifetimes) > HEADER_TIMEOUT - 0.5, min(lifetimes)

    asyncio.run(main())
    with door.client() as c:
        assert c.get("/health").status_code == 200


def test_the_next_request_on_a_kept_alive_connection_is_timed_too(door):
    async def main() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", door.port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        w.write(b"GET /heal")  # and then, slowly, the rest
        got = await _until_closed(r, w, HEADER_TIMEOUT + 3, b"th HTTP/1.1\r\n", (0.5, 0.8))
        assert got.startswith(b"HTTP/1.1 408"), got
        assert time.monotonic() - start < HEADER_TIMEOUT + 2

    asyncio.run(main())


def test_a_slow_body_gets_408_and_the_connection_closes(door):
    async def main() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", door.port)
        start = time.monotonic()
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"prompt": "'
        )
        got = await _until_closed(r, w, BODY_TIMEOUT + 3, b"a" * 80, (0.3, 0.5))
        w.close()
        assert got.startswith(b"HTTP/1.1 408"), got
        assert b'"code":408' in got.replace(b" ", b"") and b"body" in got
        assert time.monotonic() - start < BODY_TIMEOUT + 2

    asyncio.run(main())


def test_connections_over_the_limit_are_refused_at_once(door):
    async def main() -> None:
        extra = 10
        conns = [
            await asyncio.open_connection("127.0.0.1", door.port)
            for _ in range(MAX_CONNECTIONS + extra)
        ]
        start = time.monotonic()
        ok = refused = 0
        for r, w in conns:
            try:
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            except (ConnectionError, asyncio.IncompleteReadError):
                refused += 1
                continue
            if head.startswith(b"HTTP/1.1 503"):
                refused += 1
            else:
                assert head.startswith(b"HTTP/1.1 200"), head
                ok += 1
        assert time.monotonic() - start < HEADER_TIMEOUT  # nobody waited on a timeout
        # The first MAX_CONNECTIONS were served (less any a previous test left open).
        assert refused >= extra and ok >= MAX_CONNECTIONS - 5, (ok, refused)
        for _, w in conns:
            w.close()

    asyncio.run(main())
    with door.client() as c:
        deadline = time.monotonic() + 5
        while c.get("/health").status_code != 200:  # the server has noticed the closes
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ---------------------------------------------------------------- slow templates


def test_a_slow_chat_template_times_out_and_health_stays_fast(door):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=door.url, timeout=30) as c:
            start = time.monotonic()
            slow = asyncio.create_task(
                c.post(
                    "/v1/chat/completions",
                    json={"messages": CHAT, "chat_template": SLOW_TEMPLATE, "max_tokens": 2},
                )
            )
            latencies = []
            while not slow.done():
                latencies.append(await _health_latency(door.port))
                await asyncio.sleep(0.05)
            r = await slow
            elapsed = time.monotonic() - start
            assert r.status_code == 400, r.text
            err = _error(r)
            assert "took longer" in err["message"] and err["param"] == "messages"
            assert TEMPLATE_TIMEOUT - 0.1 < elapsed < TEMPLATE_TIMEOUT + 2, elapsed
            assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
            # The runaway template was stopped: its thread serves the next ones.
            for _ in range(6):
                ok = await c.post(
                    "/v1/chat/completions",
                    json={
                        "messages": CHAT,
                        "chat_template": "{{ messages[0]['content'] }}!",
                        "max_tokens": 3,
                    },
                )
                assert ok.status_code == 200, ok.text

    asyncio.run(main())


# ---------------------------------------------------------------- amplification and queues


def test_prompts_times_n_over_the_bound_is_400(door):
    with door.client() as c:
        r = c.post("/v1/completions", json={"prompt": [[5, 6], [7, 8], [9, 10]], "n": 3})
        assert r.status_code == 400 and _error(r)["param"] == "n", r.text
        assert "at most 8" in _error(r)["message"]
        r = c.post("/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 2})
        assert r.status_code == 400 and _error(r)["param"] == "prompt"
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "n": 9})
        assert r.status_code == 400 and _error(r)["param"] == "n"
        r = c.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "n": 3, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 6


def _hold(door: Door, stack: contextlib.ExitStack, path: str, body: dict) -> None:
    """Start a streamed request and keep it open (its response has begun: admitted)."""
    client = stack.enter_context(door.client())
    r = stack.enter_context(client.stream("POST", path, json={**body, "stream": True}))
    assert r.status_code == 200, r.read()


def _refused_429(r: httpx.Response, what: str) -> None:
    assert r.status_code == 429, r.text
    err = _error(r)
    assert err["type"] == "rate_limit_error" and what in err["message"], err
    assert int(r.headers["Retry-After"]) >= 1


def _admitted_within(door: Door, body: dict, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    with door.client() as c:
        while True:
            r = c.post("/v1/completions", json=body)
            if r.status_code == 200:
                return
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.05)


def test_sequences_waiting_are_bounded_429(door):
    """2 run, 4 may wait: a request of n=6 takes them all; one more sequence is refused."""
    small = {"prompt": "x", "max_tokens": 2}
    with door.paused(), contextlib.ExitStack() as stack:
        _hold(door, stack, "/v1/chat/completions", {"messages": CHAT, "n": 6, "max_tokens": 2})
        with door.client() as c:
            _refused_429(c.post("/v1/completions", json=small), "sequences")
    _admitted_within(door, small)


def test_prompt_tokens_queued_are_bounded_429_and_one_too_big_is_400(door):
    with door.paused(), contextlib.ExitStack() as stack:
        _hold(door, stack, "/v1/completions", {"prompt": list(range(100, 2100)), "max_tokens": 2})
        with door.client() as c:
            r = c.post("/v1/completions", json={"prompt": list(range(100, 1200)), "max_tokens": 2})
            _refused_429(r, "prompt tokens")
            # Alone more than the queue may ever hold: no retry helps.
            r = c.post(
                "/v1/completions", json={"prompt": list(range(100, 1700)), "n": 2, "max_tokens": 2}
            )
            assert r.status_code == 400 and _error(r)["param"] == "prompt", r.text
    _admitted_within(door, {"prompt": list(range(100, 1100)), "max_tokens": 2})


def test_a_chat_without_max_tokens_gets_the_server_default(door):
    fake = door.fake
    with door.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert fake.adds[-1].sampling.max_tokens == 5
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 40})
        assert r.status_code == 200 and fake.adds[-1].sampling.max_tokens == 40


def test_the_default_is_capped_by_the_context_left(default_model):
    from transformers import AutoTokenizer

    from subway.frontend.chat import chat_job
    from subway.frontend.inputs import Limits
    from subway.frontend.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(default_model)
    req = ChatCompletionRequest(messages=CHAT)
    job = chat_job(req, tok, Limits(4096, len(tok), chat_max_tokens=2048))
    assert job.sampling[0].max_tokens == 2048
    room = 40 - len(job.prompts[0].ids)
    assert (
        chat_job(req, tok, Limits(40, len(tok), chat_max_tokens=2048)).sampling[0].max_tokens
        == room
    )


# ---------------------------------------------------------------- request fields


def test_stop_strings_are_bounded_in_count_and_length(door):
    from subway.frontend.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS) == (16, 256)
    with door.client() as c:
        for stop in (["s"] * 17, "z" * 257, ["ok", "z" * 257]):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": stop})
            assert r.status_code == 400 and _error(r)["param"] == "stop", r.text
        most = [f"{i:02d}" + "z" * 254 for i in range(16)]
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stop": most})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, [True], {"on": True}])
def test_stream_of_the_wrong_json_type_is_400(door, value):
    with door.client() as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
        ):
            r = c.post(path, json={**body, "stream": value})
            assert r.status_code == 400 and _error(r)["param"] == "stream", (value, r.text)
