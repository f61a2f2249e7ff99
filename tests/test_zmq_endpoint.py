"""The native ZMQ endpoint's door, in process: the envelope and the API key are checked
before the body is decoded, every malformed message gets an error answer (and is
counted), oversize messages never reach it, and it serves on after all of them.

The endpoint here answers a good request by echoing its prompt, so these tests need
no engine; `test_client.py` runs the real pipeline behind it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import types

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from subway.client import AsyncClient, Client, RequestError
from subway.client.protocol import (
    MAX_REQUEST_ID_BYTES,
    PROTOCOL,
    AbortGenerate,
    FromFrontendEndpoint,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
)
from subway.client.zmq_curve import ServerKeyError, read_public_key
from subway.frontend.engine_client import RequestStream
from subway.frontend.errors import APIError
from subway.frontend.middleware import AccessRecord
from subway.frontend.pipeline import ServingContext
from subway.frontend.zmq_endpoint import CURVE_OVERHEAD, RECV_HWM, SEND_HWM, ClientEndpoint
from subway.ipc import curve
from subway.ipc.config import EngineConfig
from subway.ipc.messages import EngineReady, Grammar, SamplingParams

from serving import KV_BLOCKS, Server, free_port

KEY = "sekret-key"
K = KEY.encode()
TIMEOUT_MS = 10_000
_answers = msgspec.msgpack.Decoder(FromFrontendEndpoint)
_enc = msgspec.msgpack.Encoder()


class EchoEndpoint(ClientEndpoint):
    """The real door; behind it, each request is answered with its own prompt."""

    async def _serve(self, identity: bytes, rid: str, msg: GenerateRequest) -> None:
        self._send(identity, GenerateOutput(rid, text=msg.prompt or "", finish_reason="stop"))


class CountingDecoder:
    """The endpoint's decoder, keeping the size of every body it was handed."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.sizes: list[int] = []

    def decode(self, data):
        self.sizes.append(len(data))
        return self.decoder.decode(data)


@contextlib.asynccontextmanager
async def endpoint(tmp_path, key: str = KEY, max_bytes: int | None = None):
    ctx = ServingContext(EngineConfig.build(api_key=key), engine=None, tokenizer=None)
    ep = EchoEndpoint(ctx, f"ipc://{tmp_path}/client.sock", max_bytes)
    ep._decoder = CountingDecoder(ep._decoder)
    await ep.start()
    try:
        yield ep
    finally:
        await ep.aclose()


@contextlib.asynccontextmanager
async def dealer(address: str):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


async def answer(sock) -> GenerateOutput | GenerateError:
    if not await sock.poll(TIMEOUT_MS):
        raise TimeoutError("the endpoint did not answer")
    return _answers.decode(await sock.recv())


async def ask(sock, frames: list[bytes]) -> GenerateOutput | GenerateError:
    await sock.send_multipart(frames)
    return await answer(sock)


def good(rid: str, prompt: str = "hello", key: bytes = K) -> list[bytes]:
    return [PROTOCOL, key, rid.encode(), _enc.encode(GenerateRequest(prompt=prompt))]


def test_wrong_key_is_refused_before_the_body_is_decoded(tmp_path):
    async def main():
        async with endpoint(tmp_path) as ep, dealer(ep.address) as sock:
            undecodable = b"\xc1"  # a byte MessagePack never uses
            for key in (b"wrong", b"", K + b"x", K[:-1]):
                err = await ask(sock, [PROTOCOL, key, b"r1", undecodable])
                assert isinstance(err, GenerateError) and (err.request_id, err.status) == (
                    "r1",
                    401,
                ), key
            assert ep._decoder.sizes == []  # no byte of those bodies was decoded
            # With the key, the same body is decoded, and fails as a body.
            err = await ask(sock, [PROTOCOL, K, b"r1", undecodable])
            assert (err.request_id, err.status) == ("r1", 400) and "malformed" in err.message
            assert ep._decoder.sizes == [1]
            out = await ask(sock, good("r2"))
            assert isinstance(out, GenerateOutput) and (out.request_id, out.text) == ("r2", "hello")
            assert ep.rejected == 5
        # The client library: a wrong key is a RequestError with 401, the right one works.
        async with endpoint(tmp_path) as ep:
            async with AsyncClient(ep.address, api_key="nope", timeout=10) as client:
                with pytest.raises(RequestError) as e:
                    await client.generate("x")
                assert e.value.status == 401
            async with AsyncClient(ep.address, api_key=KEY, timeout=10) as client:
                assert (await client.generate("abc")).text == "abc"

    asyncio.run(main())


BAD = [
    # (frames, status, request id of the answer)
    ([b"hello"], 400, ""),
    ([PROTOCOL, K], 400, ""),
    ([PROTOCOL, K, b"r"], 400, ""),
    ([*good("r"), b"extra"], 400, ""),
    ([PROTOCOL] * 1000, 400, ""),  # too many frames: dropped as they are read
    ([b"subway/0", K, b"r", _enc.encode(GenerateRequest(prompt="x"))], 400, ""),
    ([PROTOCOL, K, b"", _enc.encode(GenerateRequest(prompt="x"))], 400, ""),
    ([PROTOCOL, K, b"r" * (MAX_REQUEST_ID_BYTES + 1), b"\x80"], 400, ""),
    ([PROTOCOL, K, b"\xff\xfe", b"\x80"], 400, ""),  # the id is not UTF-8
    ([PROTOCOL, b"k" * 5000, b"r", b"\x80"], 400, ""),  # an over-long key
    ([PROTOCOL, K, b"r", b""], 400, "r"),
    ([PROTOCOL, K, b"r", b"\xc1\xc1"], 400, "r"),  # not MessagePack
    ([PROTOCOL, K, b"r", _enc.encode(42)], 400, "r"),  # not a message
    ([PROTOCOL, K, b"r", _enc.encode({"type": "explode"})], 400, "r"),  # unknown kind
    ([PROTOCOL, K, b"r", _enc.encode({"type": "generate", "prompt": 5})], 400, "r"),
    ([PROTOCOL, K, b"r", _enc.encode({"type": "generate", "stream": "yes"})], 400, "r"),
    ([PROTOCOL, K, b"r", _enc.encode({"type": "generate", "api_key": KEY})], 400, "r"),
    ([PROTOCOL, K, b"r", _enc.encode({"type": "generate", "params": [1]})], 400, "r"),
]


def test_malformed_messages_get_error_answers_and_the_endpoint_serves_on(tmp_path):
    async def main():
        async with endpoint(tmp_path) as ep, dealer(ep.address) as sock:
            for i, (frames, status, rid) in enumerate(BAD):
                err = await ask(sock, frames)
                assert isinstance(err, GenerateError), (i, err)
                assert (err.status, err.request_id) == (status, rid), (i, err)
                assert ep.rejected == i + 1
                # ... and the endpoint still serves a good request after each.
                out = await ask(sock, good(f"ok{i}", f"p{i}"))
                assert isinstance(out, GenerateOutput) and out.text == f"p{i}", (i, out)
            # An abort of a request not in flight is answered by nothing (a normal race).
            await sock.send_multipart([PROTOCOL, K, b"x", _enc.encode(AbortGenerate())])
            out = await ask(sock, good("after-abort"))
            assert out.request_id == "after-abort"
            assert ep.rejected == len(BAD)

    asyncio.run(main())


def test_a_client_with_no_connection_fails_its_request_and_never_blocks(tmp_path):
    """A DEALER without a pipe (as after a peer refused its handshake) cannot take a
    message, and a blocking send waits forever: `Client.submit` fails the request (503)
    and `abort` drops what it cannot send, both at once."""
    address = f"ipc://{tmp_path}/nobody.sock"
    done: dict = {}

    def run() -> None:
        with Client(address, api_key=KEY, timeout=5) as client:
            client._sock.disconnect(address)  # the one pipe goes: nothing can be queued
            with pytest.raises(RequestError) as e:
                client.generate("x", max_tokens=2)
            done["status"] = e.value.status
            rid = client.submit("y")
            client.abort(rid)
            done["aborted"] = rid not in client._open

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a send blocked"
    assert done == {"status": 503, "aborted": True}


def test_oversize_messages_are_refused(tmp_path):
    limit = 64 << 10

    async def main():
        async with endpoint(tmp_path, max_bytes=limit) as ep, dealer(ep.address) as sock:
            assert ep.max_bytes == limit
            assert ep._sock.getsockopt(zmq.MAXMSGSIZE) == limit
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                # A frame over the bound: libzmq drops the connection that sent it, and
                # the endpoint never sees the message.
                await sock.send_multipart(good("big", "x" * (2 * limit)))
                assert await monitor.poll(TIMEOUT_MS), "the connection was not dropped"
            finally:
                sock.disable_monitor()
                monitor.close()
            # The client reconnects; its next request is served, and is the first answer.
            out = await ask(sock, good("after", "small"))
            assert isinstance(out, GenerateOutput) and out.request_id == "after"
            assert ep.rejected == 0 and all(n < limit for n in ep._decoder.sizes)
            # Frames each under the bound, over it together: a 413, body undecoded.
            decoded = len(ep._decoder.sizes)
            body = _enc.encode(GenerateRequest(prompt="y" * (limit - 100)))
            err = await ask(sock, [PROTOCOL, K, b"r" * MAX_REQUEST_ID_BYTES, body])
            assert isinstance(err, GenerateError) and (err.request_id, err.status) == (
                "r" * MAX_REQUEST_ID_BYTES,
                413,
            )
            assert len(ep._decoder.sizes) == decoded and ep.rejected == 1
            assert (await ask(sock, good("last"))).request_id == "last"

    asyncio.run(main())


def test_the_endpoint_bound_is_at_most_the_engine_message_bound(tmp_path):
    ctx = ServingContext(EngineConfig.build(max_message_bytes=1000), engine=None, tokenizer=None)
    assert ClientEndpoint(ctx, "ipc://unused").max_bytes == 1000
    assert ClientEndpoint(ServingContext(EngineConfig.build(), None, None), "ipc://x").max_bytes < (
        EngineConfig.build().ipc.max_message_bytes
    )


def test_clients_fail_every_request_when_the_endpoint_cannot_read_them(tmp_path):
    """An error without a request id (the envelope was broken) ends all in flight."""
    address = f"ipc://{tmp_path}/stub.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    broken = _enc.encode(GenerateError("", 400, "expected 4 frames"))

    def serve_once(n: int) -> None:
        """Take `n` messages, then answer the first peer with one connection error."""
        frames = [router.recv_multipart() for _ in range(n)]
        assert all(len(f) == 5 and f[1] == PROTOCOL for f in frames)
        router.send_multipart([frames[0][0], broken])

    try:
        with Client(address, timeout=10) as client:
            stub = threading.Thread(target=serve_once, args=(2,))
            stub.start()
            r1 = client.submit("a")
            r2 = client.submit("b")
            stub.join(10)
            for rid in (r1, r2):
                with pytest.raises(RequestError) as e:
                    list(client.outputs(rid))
                assert e.value.status == 400

        async def main():
            async with AsyncClient(address, timeout=10) as client:
                stub = threading.Thread(target=serve_once, args=(2,))
                stub.start()
                outs = [client.generate("a"), client.generate("b")]
                results = await asyncio.gather(*outs, return_exceptions=True)
                stub.join(10)
                assert all(isinstance(r, RequestError) and r.status == 400 for r in results)

        asyncio.run(main())
    finally:
        router.close()
        ctx.term()


def test_envelope_limits_are_checked_by_the_client(tmp_path):
    with Client(f"ipc://{tmp_path}/none.sock", api_key="k" * 2000) as client:
        with pytest.raises(ValueError):
            client.submit("x")
    with Client(f"ipc://{tmp_path}/none.sock") as client:
        with pytest.raises(ValueError):
            client.submit("x", request_id="r" * (MAX_REQUEST_ID_BYTES + 1))


class RecordingEngine:
    """Behind the endpoint's real pipeline: ready, and keeping what was submitted."""

    def __init__(self, vocab_size: int) -> None:
        ready = EngineReady(
            num_blocks=64, block_size=16, max_model_len=256, vocab_size=vocab_size,
            eos_token_ids=[2],
        )  # fmt: skip
        self.link = types.SimpleNamespace(info=ready, ready=True, error=None, stats=None)
        self.config = EngineConfig.build()  # what EngineClient has (its output bounds)
        self.submitted: list[SamplingParams] = []

    def check_capacity(self, n: int, tokens: int = 0) -> None:
        pass

    def submit(self, request_id: str, prompt_ids, sampling: SamplingParams, **_) -> RequestStream:
        self.submitted.append(sampling)
        return RequestStream(request_id, time.time(), on_close=lambda _s: None)


def test_structured_outputs_are_compiled_and_refused_as_over_http(default_model, tmp_path):
    """The endpoint builds its sampling as /v1/completions does: the grammar, logit_bias and
    min_tokens reach the engine; a grammar that does not compile is a 400 sent nowhere."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    engine = RecordingEngine(len(tok))
    ctx = ServingContext(EngineConfig.build(), engine=engine, tokenizer=tok)
    ep = ClientEndpoint(ctx, f"ipc://{tmp_path}/client.sock")

    async def admit(params: dict):
        group = await ep._admit(GenerateRequest(prompt="hi", params=params), AccessRecord())
        group.close()

    async def main():
        await admit({"structured_outputs": {"choice": ["yes", "no"]}, "logit_bias": {"5": 1.0},
                     "min_tokens": 2})  # fmt: skip
        await admit({"response_format": {"type": "json_object"}})
        for bad in (
            {"structured_outputs": {"regex": "(x"}},
            {"guided_json": "not json"},
            {"guided_regex": "a", "guided_choice": ["b"]},
            {"logit_bias": {str(len(tok)): 1.0}},
        ):
            with pytest.raises(APIError) as e:
                await admit(bad)
            assert e.value.status == 400, bad

    asyncio.run(main())
    first, second = engine.submitted
    assert first.grammar == Grammar("ebnf", 'root ::= "yes" | "no"')
    assert first.logit_bias == {5: 1.0} and first.min_tokens == 2
    assert second.grammar == Grammar("json_object")


# ------------------------------------------------------------ tcp://: CurveZMQ


class Tap:
    """A TCP relay between clients and an endpoint that keeps every byte it carries: what
    an eavesdropper on the network would read."""

    def __init__(self, target: str) -> None:
        host, _, port = target[len("tcp://") :].rpartition(":")
        self.target = (host, int(port))
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def endpoint_key(tmp_path) -> tuple[str, str]:
    """(the endpoint's key file, its public part): as `subway keygen FILE` makes them."""
    path = str(tmp_path / "endpoint.key")
    curve.write_public_file(path + ".pub", curve.write_key_file(path).public)
    return path, path + ".pub"


@contextlib.asynccontextmanager
async def tcp_endpoint(key_file: str, key: str = KEY):
    config = EngineConfig.build(api_key=key, client_curve_key_file=key_file)
    ep = EchoEndpoint(ServingContext(config, engine=None, tokenizer=None), _tcp())
    ep._decoder = CountingDecoder(ep._decoder)
    await ep.start()
    try:
        yield ep
    finally:
        await ep.aclose()


def test_tcp_needs_a_key_file_and_no_other_transport_is_taken(endpoint_key, tmp_path):
    key_file, public_file = endpoint_key

    def make(address: str, **flat) -> ClientEndpoint:
        return ClientEndpoint(ServingContext(EngineConfig.build(**flat), None, None), address)

    with pytest.raises(ValueError, match="--client-curve-key-file"):
        make("tcp://127.0.0.1:5555")
    for address in ("inproc://x", "ws://127.0.0.1:5555", "tipc://x", "127.0.0.1:5555"):
        with pytest.raises(ValueError, match="ipc:// or tcp://"):
            make(address)
    os.chmod(key_file, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        make("tcp://127.0.0.1:5555", client_curve_key_file=key_file)
    # The client: a tcp:// endpoint needs the server's public key, and only that.
    with pytest.raises(ValueError, match="server_key_file"):
        Client("tcp://127.0.0.1:5555")
    with pytest.raises(ServerKeyError, match="secret key"):
        Client("tcp://127.0.0.1:5555", server_key_file=key_file)
    bare = tmp_path / "bare.pub"
    bare.write_text(read_public_key(public_file).decode() + "\n")
    assert read_public_key(str(bare)) == read_public_key(public_file)
    bare.write_text("not a key\n")
    with pytest.raises(ServerKeyError):
        read_public_key(str(bare))


def test_over_tcp_only_the_api_key_gets_in_and_nothing_crosses_in_clear(endpoint_key):
    """A peer without the API key (a plain socket, or CURVE with the wrong key) is turned
    away in the handshake: not one byte of its messages is decoded, the clients hear 401
    at once (not a timeout), and the endpoint serves on. What the right client sends
    crosses the wire encrypted: no API key, prompt or envelope in the bytes a tap reads."""
    key_file, public_file = endpoint_key
    secret_prompt = "the-prompt-nobody-may-read"

    async def main():
        async with tcp_endpoint(key_file) as ep, dealer(ep.address) as plain:
            await plain.send_multipart(good("p1"))  # the right key, but in clear
            assert not await plain.poll(1000), "a plaintext peer got an answer"
            with pytest.raises(RequestError) as e:
                async with AsyncClient(ep.address, "wrong", 10, public_file) as client:
                    await client.generate("x")
            assert e.value.status == 401
            # Turned away in the handshake: no message of theirs reached the read loop.
            assert ep._decoder.sizes == [] and ep._refused == 0 and ep.rejected >= 1
            tap = Tap(ep.address)
            try:
                async with AsyncClient(tap.address, KEY, 10, public_file) as client:
                    assert (await client.generate(secret_prompt)).text == secret_prompt
            finally:
                tap.close()
            assert len(tap.seen) > len(secret_prompt)
            for clear in (K, secret_prompt.encode(), PROTOCOL):
                assert clear not in tap.seen
            assert len(ep._decoder.sizes) == 1

    asyncio.run(main())
    with contextlib.ExitStack() as stack:  # the blocking client, and a wrong server key
        ep_loop = stack.enter_context(_running(tcp_endpoint(key_file)))
        address = ep_loop.address
        with Client(address, KEY, 10, public_file) as client:
            assert client.generate("abc").text == "abc"
        with Client(address, "wrong", 10, public_file) as client:
            with pytest.raises(RequestError) as e:
                client.generate("abc")
            assert e.value.status == 401
        other = os.path.join(os.path.dirname(public_file), "other.pub")
        curve.write_public_file(other, curve.new_keypair().public)
        with Client(address, KEY, 10, other) as client:
            with pytest.raises(RequestError) as e:
                client.generate("abc")
            assert e.value.status == 503


def test_without_an_api_key_tcp_is_still_encrypted(endpoint_key):
    key_file, public_file = endpoint_key

    async def main():
        async with tcp_endpoint(key_file, key="") as ep:
            tap = Tap(ep.address)
            try:
                async with AsyncClient(tap.address, "", 10, public_file) as client:
                    assert (await client.generate("plain-words")).text == "plain-words"
            finally:
                tap.close()
            assert b"plain-words" not in tap.seen and PROTOCOL not in tap.seen

    asyncio.run(main())


def test_queues_and_messages_are_bounded(endpoint_key, tmp_path):
    """No unbounded queue for a client that does not read (SNDHWM 0 was one), a bounded
    read-ahead per client, and ZMQ_MAXMSGSIZE on both transports."""
    key_file, _ = endpoint_key

    async def main():
        for make in (lambda: endpoint(tmp_path), lambda: tcp_endpoint(key_file)):
            async with make() as ep:
                sock = ep._sock
                assert sock.getsockopt(zmq.SNDHWM) == SEND_HWM > 0
                assert sock.getsockopt(zmq.RCVHWM) == RECV_HWM > 0
                over = CURVE_OVERHEAD if ep.address.startswith("tcp://") else 0
                assert sock.getsockopt(zmq.MAXMSGSIZE) == ep.max_bytes + over

    asyncio.run(main())


class _running:
    """An async endpoint context run on a loop of its own thread, for blocking clients."""

    def __init__(self, cm) -> None:
        self._cm = cm
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ClientEndpoint:
        self._thread.start()
        run = asyncio.run_coroutine_threadsafe
        return run(self._cm.__aenter__(), self._loop).result(10)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._cm.__aexit__(None, None, None), self._loop).result(
            10
        )
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def test_serve_with_a_tcp_endpoint_admits_only_the_key_and_encrypts(
    tiny_models, endpoint_key, tmp_path
):
    """A live `subway serve --client-addr tcp://...`: the key holder streams tokens through
    a tap that reads neither the API key nor the prompt; a plaintext peer with the right
    key in its envelope, and a CURVE peer with a wrong key, are turned away in the
    handshake; serve keeps running and HTTP keeps answering."""
    key_file, public_file = endpoint_key
    api_key_file = tmp_path / "api.key"
    api_key_file.write_text(KEY)
    api_key_file.chmod(0o600)
    address = _tcp()
    flags = ["--client-addr", address, "--client-curve-key-file", key_file]
    flags += ["--api-key-file", str(api_key_file), "--max-model-len", "512", *KV_BLOCKS]
    server = Server(tiny_models["qwen2"], *flags)
    prompt = "Subway trains run every few minutes because"
    tap = Tap(address)
    try:
        plain = zmq.Context.instance().socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(address)
        plain.send_multipart(good("p1", prompt))
        assert not plain.poll(1000), "a plaintext peer got an answer"
        plain.close()
        with Client(address, "wrong", 30, public_file) as client:
            with pytest.raises(RequestError) as e:
                client.generate(prompt, max_tokens=4)
            assert e.value.status == 401
        with Client(tap.address, KEY, 60, public_file) as client:
            outs = list(client.stream(prompt, max_tokens=8, temperature=0, ignore_eos=True))
        assert sum(len(o.token_ids) for o in outs) == 8 and outs[-1].finish_reason == "length"
        for clear in (K, prompt.encode(), PROTOCOL):
            assert clear not in tap.seen
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": prompt, "max_tokens": 2}
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and server.proc.poll() is None
    finally:
        tap.close()
        server.stop()
