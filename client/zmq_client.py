"""Python clients for the frontend's native ZMQ endpoint: blocking `Client`, asyncio `AsyncClient`.

The native endpoint skips HTTP and JSON: one DEALER socket to the frontend's
ROUTER (`ipc://{run_dir}/client.sock` by default; the frontend logs it),
MessagePack bodies in a small envelope of frames (`subway.client.protocol`),
many requests in flight on one connection.

    from subway.client import Client
    with Client("ipc:///tmp/subway-RUNID/client.sock") as client:
        for out in client.stream("The capital of France is", max_tokens=16, temperature=0):
            print(out.text, end="", flush=True)

`params` are the fields of an OpenAI completions request (`max_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`,
`ignore_eos`, penalties, `logprobs`, `timeout`, ...). A prompt is text or a
list of token ids. Leaving a stream early aborts its request; so does
`abort(request_id)` and closing the client. A refused or failed request raises
`RequestError` (with an HTTP-like `status`: 400, 401, 429, 503, ...).

Over tcp:// the endpoint speaks CurveZMQ (`zmq_curve.py`): give the client the
server's public key as a file, `server_key_file` (FILE.pub beside the server's
`--client-curve-key-file FILE`). The API key then never crosses the wire: the
client's CURVE key pair is derived from it, and the endpoint admits only that
pair in the handshake. A refused handshake (a wrong API key: 401; a wrong server
key: 503) fails every request in flight, and the ones after it, at once.

    with Client("tcp://gpu-host:5555", api_key=key, server_key_file="server.key.pub") as c:
        print(c.generate("The capital of France is", max_tokens=8).text)

`Client` is not thread-safe: use one per thread, or `AsyncClient` on an event
loop. This module imports only msgspec and pyzmq.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from subway.client.protocol import (
    CONNECTION_ERROR_ID,
    AbortGenerate,
    FromFrontendEndpoint,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    envelope,
)
from subway.client.zmq_curve import curve_client_options, is_tcp, read_public_key


@dataclass
class Completion:
    """A finished request: all its text and tokens."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    logprobs: list[float] | None = None

    def add(self, out: GenerateOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.prompt_tokens = self.prompt_tokens or out.prompt_tokens
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason


_encoder = msgspec.msgpack.Encoder()


def _ends(answer: GenerateOutput | GenerateError) -> bool:
    """The answer is its request's last: an error, or an output with a finish_reason."""
    return isinstance(answer, GenerateError) or answer.finish_reason is not None


def _broken(answer: GenerateOutput | GenerateError) -> bool:
    """The endpoint could not read a message of ours at all: every request in flight fails."""
    return isinstance(answer, GenerateError) and answer.request_id == CONNECTION_ERROR_ID


def _output(answer: GenerateOutput | GenerateError) -> GenerateOutput:
    if isinstance(answer, GenerateError):
        raise RequestError(answer.status, answer.message)
    return answer


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class _Dealer:
    """What both clients share: a DEALER socket to the endpoint, and how requests are made.

    On tcp:// the socket is a CurveZMQ client (`server_key_file`: the server's public key)
    and a monitor socket reports its handshakes (`_handshake`)."""

    def __init__(
        self,
        address: str,
        api_key: str,
        timeout: float | None,
        ctx,
        server_key_file: str | None = None,
    ) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        self._ctx = ctx
        try:
            curve_opts = self._curve_options(address, api_key, server_key_file)
        except BaseException:
            ctx.term()
            raise
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        for option, value in curve_opts.items():
            self._sock.setsockopt(option, value)
        self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_EVENTS) if curve_opts else None
        self._refusal: GenerateError | None = None  # the last handshake's failure
        self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(FromFrontendEndpoint)

    @staticmethod
    def _curve_options(address: str, api_key: str, server_key_file: str | None) -> dict:
        if not is_tcp(address):
            return {}
        if not server_key_file:
            raise ValueError(
                f"{address} is a tcp:// endpoint, which speaks CurveZMQ: give server_key_file, "
                "the server's public key (FILE.pub beside its --client-curve-key-file FILE)"
            )
        return curve_client_options(api_key, read_public_key(server_key_file))

    def _handshake(self, frames: list[bytes]) -> GenerateError | None:
        """A monitor event: the refusal to fail requests with, or None (a handshake
        that succeeded clears an earlier refusal)."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refusal = None
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._refusal = GenerateError(
                CONNECTION_ERROR_ID, 401, f"{self.address} refused this client: wrong API key"
            )
        else:
            self._refusal = GenerateError(
                CONNECTION_ERROR_ID,
                503,
                f"the CurveZMQ handshake with {self.address} failed: is server_key_file the "
                "endpoint's public key?",
            )
        return self._refusal

    def _request(
        self, prompt: str | list[int], request_id: str | None, params: dict[str, Any], live
    ) -> tuple[str, list[bytes]]:
        """A new request's id (a fresh one by default, not in `live`) and its frames."""
        rid = request_id or uuid.uuid4().hex
        if rid in live:
            raise ValueError(f"request id {rid!r} is in flight")
        if isinstance(prompt, str):
            req = GenerateRequest(prompt=prompt, params=params)
        else:
            req = GenerateRequest(prompt_token_ids=list(prompt), params=params)
        return rid, self._frames(rid, req)

    def _unsent(self) -> GenerateError:
        """What a request fails with when no connection could take it."""
        return self._refusal or GenerateError(
            CONNECTION_ERROR_ID, 503, f"no connection to {self.address} could take the request"
        )

    def _frames(self, request_id: str, msg: GenerateRequest | AbortGenerate) -> list[bytes]:
        return envelope(self.api_key, request_id, _encoder.encode(msg))

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=200)  # time for the aborts to leave
        self._ctx.term()


class Client(_Dealer):
    """A blocking client for the native ZMQ endpoint.

    `timeout`: seconds to wait for the next answer before TimeoutError (None: forever).
    """

    def __init__(
        self,
        address: str,
        api_key: str = "",
        timeout: float | None = 300.0,
        server_key_file: str | None = None,
    ) -> None:
        super().__init__(address, api_key, timeout, zmq.Context(), server_key_file)
        self._inbox: dict[str, collections.deque] = {}
        self._open: set[str] = set()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Abort what is in flight and close the socket. Idempotent."""
        if self._sock.closed:
            return
        for rid in list(self._open):
            self.abort(rid)
        self._close_socket()

    def submit(self, prompt: str | list[int], request_id: str | None = None, **params) -> str:
        """Send a request; read its outputs with `outputs(request_id)`. Returns its id."""
        rid, frames = self._request(prompt, request_id, params, self._open)
        self._open.add(rid)
        self._inbox[rid] = collections.deque()
        if not self._send_now(frames):
            self._inbox[rid].append(self._unsent())
        elif self._refusal is not None:  # refused before: this request is too
            self._inbox[rid].append(self._refusal)
        return rid

    def outputs(self, request_id: str) -> Iterator[GenerateOutput]:
        """A submitted request's outputs, up to the one with a finish_reason.

        Leaving the loop early aborts the request."""
        finished = False
        try:
            while not finished:
                answer = self._next(request_id)
                finished = _ends(answer)
                yield _output(answer)
        finally:
            if not finished:
                self.abort(request_id)
            self._forget(request_id)

    def stream(self, prompt: str | list[int], **params) -> Iterator[GenerateOutput]:
        """Submit and stream: each output has the new `token_ids` and `text`."""
        return self.outputs(self.submit(prompt, **params))

    def generate(self, prompt: str | list[int], **params) -> Completion:
        """Submit and wait for the whole answer."""
        done = Completion()
        for out in self.stream(prompt, **params):
            done.add(out)
        return done

    def abort(self, request_id: str) -> None:
        if request_id in self._open and not self._sock.closed:
            self._send_now(self._frames(request_id, AbortGenerate()))  # best effort
        self._forget(request_id)

    def _send_now(self, frames: list[bytes]) -> bool:
        """Queue `frames` without waiting; False where no connection can take them. A
        DEALER whose one peer refused its handshake may hold no pipe at all, and a
        blocking send there waits forever (an abort after a 401 did, at random)."""
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _forget(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._inbox.pop(request_id, None)

    def _next(self, request_id: str) -> GenerateOutput | GenerateError:
        box = self._inbox.get(request_id)
        if box is None:
            raise KeyError(f"no request {request_id!r} in flight")
        while not box:
            timeout_ms = None if self.timeout is None else int(self.timeout * 1000)
            ready = dict(self._poller.poll(timeout_ms))
            if not ready:
                raise TimeoutError(f"no answer from {self.address} in {self.timeout} s")
            if self._monitor is not None and self._monitor in ready:
                refusal = self._handshake(self._monitor.recv_multipart())
                if refusal is not None:
                    for other in self._inbox.values():
                        other.append(refusal)
                continue
            msg = self._decoder.decode(self._sock.recv())
            if _broken(msg):
                for other in self._inbox.values():
                    other.append(msg)
                continue
            other = self._inbox.get(msg.request_id)
            if other is not None:  # answers for other requests wait in their inbox
                other.append(msg)
        return box.popleft()


class AsyncClient(_Dealer):
    """An asyncio client for the native ZMQ endpoint; use it from one event loop."""

    def __init__(
        self,
        address: str,
        api_key: str = "",
        timeout: float | None = 300.0,
        server_key_file: str | None = None,
    ) -> None:
        super().__init__(address, api_key, timeout, zmq.asyncio.Context(), server_key_file)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._sock.closed:
            return
        for rid in list(self._queues):
            self.abort(rid)
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.sleep(0.05)  # let the aborts leave
        self._close_socket()

    def submit(self, prompt: str | list[int], request_id: str | None = None, **params) -> str:
        rid, frames = self._request(prompt, request_id, params, self._queues)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_loop(), name="subway-client-reader")
        if self._monitor is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch(), name="subway-client-handshakes")
        self._queues[rid] = asyncio.Queue()
        if self._refusal is not None:  # refused before: this request is too
            self._queues[rid].put_nowait(self._refusal)
        self._sock.send_multipart(frames)
        return rid

    async def outputs(self, request_id: str) -> AsyncIterator[GenerateOutput]:
        queue = self._queues.get(request_id)
        if queue is None:
            raise KeyError(f"no request {request_id!r} in flight")
        finished = False
        try:
            while not finished:
                if self.timeout is None:
                    out = await queue.get()
                else:
                    try:
                        out = await asyncio.wait_for(queue.get(), self.timeout)
                    except TimeoutError:
                        raise TimeoutError(
                            f"no answer from {self.address} in {self.timeout} s"
                        ) from None
                if isinstance(out, BaseException):
                    raise out
                finished = _ends(out)
                yield _output(out)
        finally:
            if not finished:
                self.abort(request_id)
            self._queues.pop(request_id, None)

    def stream(self, prompt: str | list[int], **params) -> AsyncIterator[GenerateOutput]:
        return self.outputs(self.submit(prompt, **params))

    async def generate(self, prompt: str | list[int], **params) -> Completion:
        done = Completion()
        async with contextlib.aclosing(self.stream(prompt, **params)) as outs:
            async for out in outs:
                done.add(out)
        return done

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None and not self._sock.closed:
            self._sock.send_multipart(self._frames(request_id, AbortGenerate()), zmq.NOBLOCK)

    async def _watch(self) -> None:
        """Handshake failures fail every request in flight (CurveZMQ, on tcp://)."""
        assert self._monitor is not None
        while True:
            refusal = self._handshake(await self._monitor.recv_multipart())
            if refusal is not None:
                for queue in self._queues.values():
                    queue.put_nowait(refusal)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = self._decoder.decode(await self._sock.recv())
                if _broken(msg):
                    for queue in self._queues.values():
                        queue.put_nowait(msg)
                    continue
                queue = self._queues.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the socket closed under us, say: fail what waits
            for queue in self._queues.values():
                queue.put_nowait(e)
