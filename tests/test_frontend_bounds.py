"""What one client can make the frontend hold or burn, bounded (issue #43).

- Grammar compiles: a schema that compiles for many seconds is a 400 at
  `--grammar-timeout`, and its compile process is killed then: nothing keeps
  burning CPU after the answer, a new schema compiles at once, and an
  unconstrained stream beside a stream of such schemas keeps its pace. The
  frontend keeps a digest per grammar checked, not its text: distinct schemas of
  a megabyte each do not grow its memory.
- A stream nobody reads: its deltas merge into one (`RequestStream`), and what
  all streams hold unread is bounded (`--max-unread-tokens`): past it, the
  stream furthest behind ends with finish_reason "abort" and its request is
  aborted.

The live tests run a real `subway serve` (a tiny model: fast steps, the default
model's tokenizer, so the same grammar compiles).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from subway.frontend.engine_client import RequestStream
from subway.frontend.errors import APIError
from subway.ipc.messages import Grammar, RequestDelta

from serving import KV_BLOCKS, Server, until

MB = 1 << 20


def slow_schema(i: int, fields: int = 50) -> dict:
    """A schema xgrammar takes seconds to compile, far past a 1 s limit (fields of
    bounded-repeat patterns, each its own automaton); `i` makes each distinct."""
    props = {
        f"p{j}": {"type": "string", "pattern": f"[a-z0-9 ]{{1,100}}x{j + 1000 * i}"}
        for j in range(fields)
    }
    return {"type": "object", "properties": props}


def small_schema(i: int) -> dict:
    return {
        "type": "object",
        "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": [f"k{i}"],
    }


def constrained(http: httpx.Client, schema: dict, timeout: float = 60) -> httpx.Response:
    """A completion with `schema` as its constraint and max_tokens 0: the frontend checks the
    grammar, and nothing goes to the engine (only the frontend's compile is measured)."""
    body = {"prompt": "x", "max_tokens": 0, "echo": True, "guided_json": schema}
    return http.post("/v1/completions", json=body, timeout=timeout)


def tree_cpu(proc: psutil.Process) -> float:
    """CPU seconds of a process and its live descendants."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Stream:
    """An unconstrained stream read on a thread: when each chunk came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.times: list[float] = []
        self.status = 0
        self.stop = False  # set: the reader leaves (and the request is aborted)
        self.finish: str | None = None
        self.tokens = 0  # the usage's completion tokens
        body = {"prompt": "a b c", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event["choices"]:
                        self.times.append(time.monotonic())
                        self.finish = event["choices"][0]["finish_reason"]
                    if event.get("usage"):
                        self.tokens = event["usage"]["completion_tokens"]
                if self.stop:
                    return

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait for a chunk between two monotonic times."""
        inside = [t for t in self.times if start <= t <= end]
        return max((b - a for a, b in zip([start, *inside], [*inside, end], strict=True)))

    def rate(self, start: float, end: float) -> float:
        """Chunks per second between two monotonic times."""
        return sum(start <= t < end for t in self.times) / (end - start)


@pytest.mark.slow
def test_slow_schemas_are_killed_at_the_limit_and_hold_nothing(tiny_models):
    """Three waves of 4 distinct slow schemas (`--grammar-timeout 1`, 2 compile processes)
    beside an unconstrained stream: each is answered at the limit (400, or 503 busy while
    both processes compile), a new schema then compiles at once, the stream keeps its
    pace (its longest gap under 3x the calm one + 0.5 s), and once answered nothing of
    the slow compiles runs (the frontend's processes idle: under 0.1 core)."""
    s = Server(
        tiny_models["llama"], "--grammar-timeout", "1", "--max-model-len", "2048", *KV_BLOCKS
    )
    try:
        frontend = s.child("frontend")
        with httpx.Client(base_url=s.url) as http:
            # The first grammar starts the compile processes (outside the time limit).
            r = constrained(http, small_schema(-1), timeout=180)
            assert r.status_code == 200, r.text
            stream = Stream(s.url, 1800)
            until(lambda: len(stream.times) >= 120, 60)  # 100 chunks after the first 20: calm
            calm = 100 / (stream.times[119] - stream.times[19])
            attack_start = time.monotonic()
            answers: list[tuple[int, float]] = []
            for wave in range(3):  # 4 distinct slow schemas at once, 3 times over
                t0 = time.monotonic()
                with httpx.Client(base_url=s.url) as h, _pool(4) as run:
                    rs = run(
                        lambda i, h=h, w=wave: constrained(h, slow_schema(w * 4 + i)), range(4)
                    )
                answers += [(r.status_code, time.monotonic() - t0) for r in rs]
                for r in rs:
                    assert r.status_code in (400, 503), r.text
                    assert "Traceback" not in r.text
            attack_end = time.monotonic()
            # Each answered at the limit (or refused as busy then), never after the compile.
            assert max(dt for _, dt in answers) < 5, answers
            assert any(code == 400 for code, _ in answers), answers
            # A new schema compiles now: no compile of the slow ones holds a worker.
            t0 = time.monotonic()
            r = constrained(http, small_schema(7))
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 5
            # Measured while the stream ran: on a fast machine (310 chunks/s calm) its 1,800
            # tokens may end before the three waves do.
            end = attack_end if stream.finish is None else min(attack_end, stream.times[-1])
            assert end - attack_start > 1.0, (attack_start, end)
            under = stream.rate(attack_start, end)
            gap = stream.max_gap(attack_start, end)
            calm_gap = stream.max_gap(stream.times[19], stream.times[119])
            # Bounded gaps, not the calm pace: on 2 cores the compile processes (niced) still
            # take CPU from the worker's two OpenMP threads, whose barriers then wait; the
            # tiny model's stream fell from ~300 to 13-22 chunks/s on a Zen 4 VM (but went
            # on, its longest gap below). It must not stop.
            assert under > 0, (calm, under)
            assert gap < 3 * calm_gap + 0.5, (calm_gap, gap)
            print(
                f"stream: {calm:.1f} chunks/s calm, {under:.1f} under attack; largest gap "
                f"{calm_gap:.3f} s calm, {gap:.3f} s under attack; answers {answers}"
            )
            stream.stop = True
            stream.thread.join(60)
            assert stream.status == 200
            # Nothing of the slow compiles still runs: the frontend and its children idle.
            cpu0, w0 = tree_cpu(frontend), time.monotonic()
            time.sleep(2)  # the window measured, not a wait for anything
            busy = (tree_cpu(frontend) - cpu0) / (time.monotonic() - w0)
            print(f"after: the frontend's processes use {busy:.2f} cores")
            assert busy < 0.1, f"the frontend's processes still use {busy:.2f} cores"
        assert s.proc.poll() is None and "Traceback" not in s.read_output()
    finally:
        s.stop()


@pytest.mark.slow
def test_distinct_large_schemas_do_not_grow_the_frontend(tiny_models):
    """60 distinct schemas of ~1 MB of text each (a long description, which compiles
    fast): the frontend keeps a digest of each, so its RSS grows by less than 24 MB."""
    s = Server(tiny_models["llama"], "--max-model-len", "512", *KV_BLOCKS)
    try:
        frontend = s.child("frontend")
        with httpx.Client(base_url=s.url, timeout=180) as http:

            def send(i: int) -> None:
                schema = {"type": "integer", "description": f"{i} " + "x" * 1_000_000}
                assert constrained(http, schema).status_code == 200

            for i in range(5):  # warm: the compile processes, the buffers of big bodies
                send(-1 - i)
            rss0 = frontend.memory_info().rss
            for i in range(60):
                send(i)
            grown = (frontend.memory_info().rss - rss0) / MB
        print(f"the frontend grew by {grown:.1f} MB")
        assert grown < 24, f"the frontend grew by {grown:.0f} MB"
        assert s.proc.poll() is None
    finally:
        s.stop()


def unread_request(port: int, body: dict) -> socket.socket:
    """A request sent on a socket with a 4 KiB receive buffer, its answer left unread."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    c.sendall(head + data)
    return c


def read_events(c: socket.socket, timeout: float = 60) -> list[dict]:
    """The SSE events of a streamed answer on `c`, read to its `[DONE]`."""
    c.settimeout(timeout)
    raw = b""
    while b"data: [DONE]" not in raw:
        chunk = c.recv(1 << 16)
        assert chunk, "the server closed the stream before [DONE]"
        raw += chunk
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


@pytest.mark.slow
def test_a_stream_nobody_reads_is_cut_at_the_unread_bound(tiny_models):
    """A streamed request of n=64 x 400 tokens with logprobs whose client does not read:
    once the socket's buffers are full (~100 steps here), past `--max-unread-tokens` (600;
    a token with 5 top logprobs counts 6) the choices furthest behind are cut, each ending
    with finish_reason "abort" after a prefix of its output, and their engine requests are
    aborted: the engine stops well before the 400 steps the request would take. The
    frontend's RSS grows by less than 16 MB, and a stream read beside it is whole."""
    s = Server(tiny_models["llama"], "--max-model-len", "1024", "--max-unread-tokens", "600",
               *KV_BLOCKS)  # fmt: skip
    c = None
    try:
        frontend = s.child("frontend")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        rss0 = frontend.memory_info().rss
        steps0 = s.metrics()["subway:num_steps_total"]
        body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 64,
                "logprobs": 5}  # fmt: skip
        c = unread_request(s.port, body)
        reader = Stream(s.url, 100)
        until(lambda: s.metrics().get("subway:num_requests_running", 0) > 0, 60)
        until(
            lambda: (
                s.metrics().get("subway:num_requests_running", 1) == 0
                and s.metrics().get("subway:num_requests_waiting", 1) == 0
            ),
            400,
        )
        steps = s.metrics()["subway:num_steps_total"] - steps0
        grown = (frontend.memory_info().rss - rss0) / MB
        print(f"{steps:.0f} steps; the frontend grew by {grown:.1f} MB")
        assert steps < 320, f"the engine ran {steps:.0f} steps for requests nobody reads"
        assert grown < 16, f"the frontend grew by {grown:.0f} MB for a stream nobody reads"
        reader.thread.join(60)
        assert (reader.status, reader.finish, reader.tokens) == (200, "length", 100)

        events = read_events(c)
        finish = {ch["index"]: ch["finish_reason"] for e in events for ch in e["choices"]
                  if ch.get("finish_reason")}  # fmt: skip
        assert len(finish) == 64 and set(finish.values()) <= {"length", "abort"}, finish
        assert "abort" in finish.values()
        assert s.proc.poll() is None and "Traceback" not in s.read_output()
    finally:
        if c is not None:
            c.close()
        s.stop()


# ---------------------------------------------------------------- below the server


def test_an_unread_stream_merges_its_deltas_into_one():
    async def main() -> None:
        stream = RequestStream("r", 0.0, on_close=lambda _s: None)
        stream.put(RequestDelta("r", [1], num_prompt_tokens=3, logprobs=[-0.5], queue_time=0.1))
        for i in range(2, 10_001):
            stream.put(RequestDelta("r", [i], logprobs=[-1.0]))
        stream.put(RequestDelta("r", [10_001], "length", logprobs=[-2.0]))
        assert stream.num_pending == 1
        delta = await anext(stream)
        assert delta.token_ids == list(range(1, 10_002))
        assert delta.logprobs == [-0.5] + [-1.0] * 9_999 + [-2.0]
        assert (delta.finish_reason, delta.num_prompt_tokens) == ("length", 3)
        assert delta.queue_time == 0.1
        assert stream.finished

        # A delta with what only a first delta carries, or other logprobs, is not merged;
        # an error after the deltas still comes after them.
        stream = RequestStream("q", 0.0, on_close=lambda _s: None)
        stream.put(RequestDelta("q", [1]))
        stream.put(RequestDelta("q", [2], logprobs=[-1.0]))
        stream.put(RequestDelta("q", [3], logprobs=[-1.0]))
        stream.put(RuntimeError("engine lost"))
        assert stream.num_pending == 3
        assert (await anext(stream)).token_ids == [1]
        assert (await anext(stream)).token_ids == [2, 3]
        with pytest.raises(RuntimeError):
            await anext(stream)

    asyncio.run(main())


def test_the_verdict_cache_holds_digests_and_is_bounded():
    from subway.frontend.grammar import SEEN_GRAMMARS, VerdictCache, digest

    cache = VerdictCache(size=100)
    for i in range(1000):
        cache.put(digest(str(i).encode()), "e" * 10_000)
    assert len(cache) == 100
    assert cache.get(digest(b"999")) == "e" * 500  # messages are cut to MAX_ERROR_CHARS
    assert cache.get(digest(b"0")) is None
    assert SEEN_GRAMMARS * (500 + 200) < 4 * MB


class _Pool:
    """A stand-in for GrammarPool: counts compiles, answers at once."""

    def __init__(self) -> None:
        self.compiles = 0
        self.broken = ""

    async def compile(self, payload: bytes, deadline: float | None) -> str | None:
        self.compiles += 1
        return "bad" if b"bad" in payload else None


def test_the_check_compiles_each_grammar_once():
    from subway.frontend.grammar import GrammarCheck

    pool = _Pool()
    check = GrammarCheck(pool, 1.0, (10, [2]))  # type: ignore[arg-type]

    async def main() -> None:
        big = Grammar("regex", "a" * 100_000)  # encoded and hashed off the loop
        for _ in range(3):
            await check.check(Grammar("regex", "a+"))
            await check.check(big)
            with pytest.raises(APIError) as e:
                await check.check(Grammar("regex", "bad"), "guided_regex")
            assert e.value.status == 400 and e.value.param == "guided_regex"
            assert e.value.message == "the regex is invalid: bad"

    asyncio.run(main())
    assert pool.compiles == 3
    assert check.counts == {"cold": 2, "cached": 4, "error": 3, "timeout": 0}


class _pool:
    """`with _pool(n) as run: run(fn, items)`: fn over items on n threads, results in order."""

    def __init__(self, n: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(n)

    def __enter__(self):
        return lambda fn, items: list(self.executor.map(fn, items))

    def __exit__(self, *exc) -> None:
        self.executor.shutdown()
