"""The frontend's native ZMQ endpoint: a ROUTER socket for `subway.client`.

It serves the same engine requests as `/v1/completions` (one prompt, one
choice), with the same checks, limits, metrics and access log, without HTTP
or JSON. The address is `config.server.client_addr`, by default
`ipc://{run_dir}/client.sock` ("off": no endpoint; `EngineConfig.client_address`). With an API key, each
request must carry it. A client that goes away is noticed when an answer
cannot be routed to it (ROUTER_MANDATORY): its request is then aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio
from pydantic import ValidationError

from subway.client.protocol import (
    AbortGenerate,
    FromFrontendEndpoint,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    ToFrontendEndpoint,
)
from subway.frontend.choices import ChoiceGroup
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.inputs import client_scheduling, completion_job
from subway.frontend.logprobs import native_logprobs
from subway.frontend.middleware import AccessRecord, access_log, log_access
from subway.frontend.pipeline import ServingContext, admit, engine_failure, new_id
from subway.frontend.protocol import CompletionRequest
from subway.ipc.sockets import bind, cleanup_ipc

log = logging.getLogger("subway.frontend")

_IGNORED = ("stream", "stream_options", "echo", "n", "best_of", "prompt", "model")


class ClientEndpoint:
    def __init__(self, ctx: ServingContext, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self._zmq: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._decoder = msgspec.msgpack.Decoder(ToFrontendEndpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._key = ctx.config.server.api_key.encode()

    async def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        self._sock = bind(self._zmq, zmq.ROUTER, self.address, ROUTER_MANDATORY=1, SNDHWM=0)
        self._reader = asyncio.create_task(self._read_loop(), name="subway-client-endpoint")
        log.info("native ZMQ endpoint at %s", self.address)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        if self._reader is not None:
            tasks.append(self._reader)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            cleanup_ipc(self.address)
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    # ------------------------------------------------------------ messages

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            identity, data = frames
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as e:
                log.warning("undecodable message on the ZMQ endpoint: %s", e)
                continue
            key = (identity, msg.request_id)
            if isinstance(msg, AbortGenerate):
                task = self._tasks.get(key)
                if task is not None:
                    task.cancel()
                continue
            if key in self._tasks:
                self._send(identity, GenerateError(msg.request_id, 400, "request id in use"))
                continue
            task = asyncio.create_task(self._serve(identity, msg))
            self._tasks[key] = task
            task.add_done_callback(lambda _t, key=key: self._tasks.pop(key, None))

    def _send(self, identity: bytes, msg: FromFrontendEndpoint) -> None:
        """Raises zmq.ZMQError when the client is gone (ROUTER_MANDATORY)."""
        if self._sock is None:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        fut = self._sock.send_multipart([identity, self._encoder.encode(msg)], zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()

    async def _serve(self, identity: bytes, msg: GenerateRequest) -> None:
        """One request through the pipeline's stages, its answers sent as they come."""
        start = time.time()
        record = AccessRecord()
        status = 200
        group = None
        try:
            group = self._admit(msg, record)
            async for out in native_outputs(
                group, msg.request_id, record.prompt_tokens, msg.stream
            ):
                self._send(identity, out)
        except zmq.ZMQError:
            status = 499  # the client is gone: leaving aborts the engine requests
        except asyncio.CancelledError:
            status = 499  # AbortGenerate, or shutdown
            with contextlib.suppress(zmq.ZMQError):
                self._send(identity, GenerateOutput(msg.request_id, finish_reason="abort"))
            raise
        except Exception as e:  # refused (an APIError), or failed
            err = engine_failure(e)
            status = err.status
            with contextlib.suppress(zmq.ZMQError):
                self._send(identity, GenerateError(msg.request_id, err.status, err.message))
        finally:
            if group is not None:
                group.close()
            self._log(msg, status, record, start)

    def _admit(self, msg: GenerateRequest, record: AccessRecord) -> ChoiceGroup | None:
        ctx = self.ctx
        if self._key and not hmac.compare_digest(msg.api_key.encode(), self._key):
            raise APIError(401, "invalid or missing API key")
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise APIError(400, "give exactly one of prompt and prompt_token_ids")
        params = {k: v for k, v in msg.params.items() if k not in _IGNORED}
        prompt = msg.prompt if msg.prompt is not None else msg.prompt_token_ids
        try:
            req = CompletionRequest.model_validate({**params, "prompt": prompt})
        except ValidationError as e:
            raise from_validation_error(e) from e
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            raise APIError(400, "one prompt per request", "prompt")
        req, _ = client_scheduling(req, ctx.config)  # no headers here: dropped quietly
        job = completion_job(req, ctx.tokenizer, ctx.limits())  # echo is ignored: it runs
        return admit(ctx, req, new_id("zmq"), job, record)

    @staticmethod
    def _log(msg: GenerateRequest, status: int, record: AccessRecord, start: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        line = {
            "method": "ZMQ",
            "path": "generate",
            "status": status,
            "client_request_id": msg.request_id,
            "latency_s": round(time.time() - start, 6),
        }
        log_access(logging.INFO, line | record.fields(start))


async def native_outputs(
    group: ChoiceGroup, request_id: str, prompt_tokens: int, stream: bool
) -> AsyncIterator[GenerateOutput]:
    """The native endpoint's answer to one request: an output per event, or one at the end."""
    pending = GenerateOutput(request_id, prompt_tokens=prompt_tokens)
    async for ev in group.events():
        pending.token_ids += ev.token_ids
        pending.text += ev.text
        if ev.logprobs is not None:
            pending.logprobs = (pending.logprobs or []) + native_logprobs(ev.logprobs)
        pending.finish_reason = ev.finish_reason
        if stream or ev.finish_reason is not None:
            yield pending
            pending = GenerateOutput(request_id)
