"""The frontend's native ZMQ endpoint: a ROUTER socket for `subway.client`.

It serves the same engine requests as `/v1/completions` (one prompt, one
choice), with the same checks, limits, metrics and access log, without HTTP
or JSON; structured outputs (`structured_outputs`, `response_format`,
`guided_*` in `params`) are compiled and refused as there (`check_grammars`), and
`params["model"]` names the base model or a LoRA adapter as there (404 for another).
The address is `config.server.client_addr`, by default
`ipc://{run_dir}/client.sock` ("off": no endpoint; `EngineConfig.client_address`).
A client that goes away is noticed when an answer cannot be routed to it
(ROUTER_MANDATORY): its request is then aborted. So is one that leaves SEND_HWM
answers unread: its queue is bounded, and a send past it fails as to a gone client.

The address is ipc:// (a socket file in the 0700 run folder: only this user can
connect) or tcp://; nothing else is taken. Over tcp:// the endpoint is a
CurveZMQ server with the key pair of `--client-curve-key-file` (required there):
everything on the wire is encrypted, and with an API key the handshake itself
authenticates (a ZAP handler admits only the client key pair the API key stands
for, `subway.client.zmq_curve`), so a peer without the key is turned away before
a byte of its messages is buffered. Clients get the server's public key as a
file (FILE.pub); the API key never crosses the wire in clear.

Every message is checked before it costs anything (`_check`): no frame over
`max_bytes` reaches us (ZMQ_MAXMSGSIZE drops the connection that sends one),
at most RECV_HWM messages of a client are read ahead,
frames past the envelope's four are dropped as they are read, and the envelope
(`subway.client.protocol`) is checked in order: frame count, protocol, sizes,
the API key (hmac.compare_digest), and only then is the body decoded as its
type. What fails is answered with a GenerateError (400, 401, 413) and counted
in `rejected`; the first rejection of each peer is logged. Nothing a peer sends
stops the endpoint.
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
    CONNECTION_ERROR_ID,
    MAX_KEY_BYTES,
    MAX_REQUEST_ID_BYTES,
    PROTOCOL,
    AbortGenerate,
    FromFrontendEndpoint,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    ToFrontendEndpoint,
)
from subway.client.zmq_curve import client_keys
from subway.frontend.choices import ChoiceGroup
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.logprobs import native_logprobs
from subway.frontend.middleware import MAX_BODY_BYTES, AccessRecord, access_log, log_access
from subway.frontend.pipeline import (
    COMPLETIONS,
    ServingContext,
    admit,
    engine_failure,
    new_id,
    prepare,
)
from subway.frontend.protocol import CompletionRequest
from subway.ipc import curve
from subway.ipc.config import EngineConfig
from subway.ipc.sockets import bind, cleanup_ipc

log = logging.getLogger("subway.frontend")

_IGNORED = ("stream", "stream_options", "echo", "n", "best_of", "prompt")
FRAMES = 5  # the peer's identity (added by ROUTER), then the envelope's four
MAX_WARNED_PEERS = 1024  # peers whose first rejection is logged; later ones are only counted
SEND_HWM = 16384  # answers queued for one client at most; past it its requests are aborted
RECV_HWM = 64  # messages of one client read ahead at most; past it libzmq stops reading it
CURVE_OVERHEAD = 64  # bytes a CURVE MESSAGE command adds to a frame (33; rounded up)
KEY_FILE_FLAG = "--client-curve-key-file"


class Rejected(Exception):
    """A message refused before it reached the pipeline: the answer to send back."""

    def __init__(self, status: int, message: str, request_id: str = CONNECTION_ERROR_ID) -> None:
        super().__init__(message)
        self.reply = GenerateError(request_id, status, message)


def endpoint_keys(config: EngineConfig, address: str) -> curve.KeyPair | None:
    """The endpoint's CurveZMQ key pair on a tcp:// `address` (None on ipc://). ValueError
    for another transport, or for tcp:// without a key file (naming the flag);
    PermissionError or KeyFileError for a bad key file (`curve.load_key_file`)."""
    if address.startswith("ipc://"):
        return None
    if not curve.is_tcp(address):
        raise ValueError(f"the native ZMQ endpoint takes ipc:// or tcp://, not {address[:80]!r}")
    path = config.server.client_curve_key_file
    if not path:
        raise ValueError(
            f"{address} is a tcp:// address: the native ZMQ endpoint there is CurveZMQ and "
            f"needs a key file, given with {KEY_FILE_FLAG} (make one with `subway keygen "
            f"FILE`; clients get its public key, FILE.pub)"
        )
    return curve.load_key_file(path)


class ClientEndpoint:
    """`rejected`: how many messages were refused (malformed, unauthenticated, too big),
    and CurveZMQ handshakes turned away (on tcp://)."""

    def __init__(self, ctx: ServingContext, address: str, max_bytes: int | None = None) -> None:
        self.ctx = ctx
        self.address = address
        self._keys = endpoint_keys(ctx.config, address)  # refused here, before any socket
        # The largest frame, and envelope, taken: as the HTTP door's body, at most the
        # engine's message bound.
        limit = ctx.config.ipc.max_message_bytes
        self.max_bytes = min(limit, max_bytes if max_bytes is not None else MAX_BODY_BYTES)
        self._refused = 0
        self._auth: curve.Authenticator | None = None
        self._warned: set[bytes] = set()
        self._zmq: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._decoder = msgspec.msgpack.Decoder(ToFrontendEndpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._key = ctx.config.server.api_key.encode()

    @property
    def rejected(self) -> int:
        denied = self._auth.provider.denied if self._auth is not None else 0
        return self._refused + denied

    async def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        opts: dict[str, int | bytes] = {
            "ROUTER_MANDATORY": 1,
            "SNDHWM": SEND_HWM,
            "RCVHWM": RECV_HWM,
            "MAXMSGSIZE": self.max_bytes,
        }
        if self._keys is not None:
            opts |= self._curve_server(self._keys)
        self._sock = bind(self._zmq, zmq.ROUTER, self.address, **opts)
        self._reader = asyncio.create_task(self._read_loop(), name="subway-client-endpoint")
        if self._keys is None:
            log.info("native ZMQ endpoint at %s", self.address)
        else:
            log.info(
                "native ZMQ endpoint at %s (CurveZMQ; server public key %s)",
                self.address,
                self._keys.public.decode(),
            )

    def _curve_server(self, keys: curve.KeyPair) -> dict[str, int | bytes]:
        """A CURVE server's options; with an API key, a ZAP handler (started before the
        bind, so that no handshake goes unchecked) admits only the key pair it stands for."""
        assert self._zmq is not None
        opts: dict[str, int | bytes] = {
            "CURVE_SERVER": 1,
            "CURVE_SECRETKEY": keys.secret,
            "MAXMSGSIZE": self.max_bytes + CURVE_OVERHEAD,
        }
        api_key = self.ctx.config.server.api_key
        if not api_key:
            log.warning(
                "the native ZMQ endpoint at %s has no API key: any client that holds its "
                "public key may send requests (encrypted)",
                self.address,
            )
            return opts
        self._auth = curve.Authenticator(self._zmq, client_keys(api_key, keys.public)[0])
        return opts | {"ZAP_DOMAIN": curve.ZAP_DOMAIN.encode()}

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
        if self._auth is not None:  # it holds a socket of the context: before term()
            self._auth.stop()
            self._auth = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    # ------------------------------------------------------------ messages

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames, count = await self._recv()
            identity = frames[0]
            try:
                rid, msg = self._check(frames, count)
                self._dispatch(identity, rid, msg)
            except Rejected as e:
                self._reject(identity, e.reply)
            except Exception:  # a bug of ours: logged, and the endpoint serves on
                log.exception("the ZMQ endpoint failed on a message")
                self._reject(identity, GenerateError(CONNECTION_ERROR_ID, 500, "internal error"))

    async def _recv(self) -> tuple[list[bytes], int]:
        """One message's first FRAMES frames, and how many it had (the rest are dropped)."""
        assert self._sock is not None
        frames: list[bytes] = []
        count = 0
        while True:
            frame = await self._sock.recv(copy=False)
            count += 1
            if count <= FRAMES:
                frames.append(frame.bytes)
            if not frame.more:
                return frames, count

    def _check(self, frames: list[bytes], count: int) -> tuple[str, ToFrontendEndpoint]:
        """The envelope, then the key, then (only then) the body; Rejected for what fails."""
        if count != FRAMES:
            raise Rejected(
                400, f"expected {FRAMES - 1} frames (protocol, key, id, body), got {count - 1}"
            )
        _, protocol, key, rid_bytes, body = frames
        if protocol != PROTOCOL:
            raise Rejected(400, f"unsupported protocol: expected {PROTOCOL.decode()}")
        if len(key) > MAX_KEY_BYTES or not 0 < len(rid_bytes) <= MAX_REQUEST_ID_BYTES:
            raise Rejected(
                400, f"a key is at most {MAX_KEY_BYTES} bytes, an id 1 to {MAX_REQUEST_ID_BYTES}"
            )
        try:
            rid = rid_bytes.decode()
        except UnicodeDecodeError:
            raise Rejected(400, "the request id is not UTF-8") from None
        if self._key and not hmac.compare_digest(key, self._key):
            raise Rejected(401, "invalid or missing API key", rid)
        if sum(map(len, frames)) > self.max_bytes:
            raise Rejected(413, f"the message is larger than {self.max_bytes} bytes", rid)
        try:
            return rid, self._decoder.decode(body)
        except msgspec.DecodeError as e:  # ValidationError (types, kinds) is one too
            raise Rejected(400, f"malformed body: {e}", rid) from None

    def _dispatch(self, identity: bytes, rid: str, msg: ToFrontendEndpoint) -> None:
        key = (identity, rid)
        if isinstance(msg, AbortGenerate):
            task = self._tasks.get(key)
            if task is not None:
                task.cancel()
            return
        if key in self._tasks:
            raise Rejected(400, "request id in use", rid)
        task = asyncio.create_task(self._serve(identity, rid, msg))
        self._tasks[key] = task
        task.add_done_callback(lambda _t, key=key: self._tasks.pop(key, None))

    def _reject(self, identity: bytes, reply: GenerateError) -> None:
        self._refused += 1
        if identity not in self._warned and len(self._warned) < MAX_WARNED_PEERS:
            self._warned.add(identity)
            log.warning("ZMQ endpoint refused a message (%d: %s)", reply.status, reply.message)
        with contextlib.suppress(zmq.ZMQError):
            self._send(identity, reply)

    def _send(self, identity: bytes, msg: FromFrontendEndpoint) -> None:
        """Raises zmq.ZMQError when the client is gone (ROUTER_MANDATORY)."""
        if self._sock is None:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        fut = self._sock.send_multipart([identity, self._encoder.encode(msg)], zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()

    async def _serve(self, identity: bytes, rid: str, msg: GenerateRequest) -> None:
        """One request through the pipeline's stages, its answers sent as they come."""
        start = time.time()
        record = AccessRecord()
        status = 200
        group = None
        try:
            group = await self._admit(msg, record)
            async for out in native_outputs(group, rid, record.prompt_tokens, msg.stream):
                self._send(identity, out)
        except zmq.ZMQError:
            status = 499  # the client is gone: leaving aborts the engine requests
        except asyncio.CancelledError:
            status = 499  # AbortGenerate, or shutdown
            with contextlib.suppress(zmq.ZMQError):
                self._send(identity, GenerateOutput(rid, finish_reason="abort"))
            raise
        except Exception as e:  # refused (an APIError), or failed
            err = engine_failure(e)
            status = err.status
            with contextlib.suppress(zmq.ZMQError):
                self._send(identity, GenerateError(rid, err.status, err.message))
        finally:
            if group is not None:
                group.close()
            self._log(rid, status, record, start)

    async def _admit(self, msg: GenerateRequest, record: AccessRecord) -> ChoiceGroup | None:
        ctx = self.ctx
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
        # As for HTTP; no headers here: dropped scheduling fields go quietly; echo is ignored.
        req, job, _ = await prepare(ctx, COMPLETIONS, req)
        return admit(ctx, req, new_id("zmq"), job, record)

    @staticmethod
    def _log(request_id: str, status: int, record: AccessRecord, start: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        line = {
            "method": "ZMQ",
            "path": "generate",
            "status": status,
            "client_request_id": request_id,
            "latency_s": round(time.time() - start, 6),
        }
        log_access(logging.INFO, line | record.fields(start))


async def native_outputs(
    group: ChoiceGroup, request_id: str, prompt_tokens: int, stream: bool
) -> AsyncIterator[GenerateOutput]:
    """The native endpoint's answer to one request: an output per event, or one at the end."""
    pending = GenerateOutput(request_id, prompt_tokens=prompt_tokens)
    texts: list[str] = []  # joined at each yield: linear in the output, not quadratic
    async for ev in group.events():
        pending.token_ids += ev.token_ids
        texts.append(ev.text)
        if ev.logprobs is not None:
            if pending.logprobs is None:
                pending.logprobs = []
            pending.logprobs.extend(native_logprobs(ev.logprobs))
        pending.finish_reason = ev.finish_reason
        if stream or ev.finish_reason is not None:
            pending.text = "".join(texts)
            yield pending
            pending, texts = GenerateOutput(request_id), []
