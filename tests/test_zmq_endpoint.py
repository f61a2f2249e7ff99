"""The native ZMQ endpoint's door, in process: the envelope and the API key are checked
before the body is decoded, every malformed message gets an error answer (and is
counted), oversize messages never reach it, and it serves on after all of them.

The endpoint here answers a good request by echoing its prompt, so these tests need
no engine; `test_client.py` runs the real pipeline behind it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types

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
from subway.frontend.engine_client import RequestStream
from subway.frontend.errors import APIError
from subway.frontend.middleware import AccessRecord
from subway.frontend.pipeline import ServingContext
from subway.frontend.zmq_endpoint import ClientEndpoint
from subway.ipc.config import EngineConfig
from subway.ipc.messages import EngineReady, Grammar, SamplingParams

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
    assert ClientEndpoint(ServingContext(EngineConfig.build(), None, None), "x").max_bytes < (
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
