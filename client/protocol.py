"""The messages of the frontend's native ZMQ endpoint (client DEALER <-> frontend ROUTER).

The one module that both sides import: the clients of `subway.client` and the
frontend's endpoint. It imports only msgspec.

A client's message is four frames, an envelope the endpoint checks without
decoding anything, then the body:

    [PROTOCOL, api_key, request_id, body]   body: MessagePack GenerateRequest | AbortGenerate

`request_id` is the client's own id (UTF-8, at most MAX_REQUEST_ID_BYTES);
`api_key` is at most MAX_KEY_BYTES. On ipc:// the frames stay on this host, in a
socket file only this user can reach; on tcp:// they travel inside CurveZMQ, and
a client gets that far only with the API key (`zmq_curve.py`). The endpoint checks the frame count, the
protocol and the key first and decodes the body only then, so a peer without
the key costs no decoding. Each answer is one frame of MessagePack that
repeats the request id:

    frontend -> client : GenerateOutput (one per step, or one at the end), GenerateError

A message the endpoint cannot take (wrong frames, a wrong key, a body that does
not decode as its type) is answered with a GenerateError (400, 401 or 413);
when the envelope itself is broken its `request_id` is "" (CONNECTION_ERROR_ID):
the clients fail every request in flight with it.

`params` takes the fields of an OpenAI completions request (`max_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`,
`ignore_eos`, penalties, `logprobs`, `skip_special_tokens`, `timeout`,
`priority`, ...), checked as the HTTP endpoint checks them.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROTOCOL = b"subway/1"  # the first frame of every client message
MAX_KEY_BYTES = 1024
MAX_REQUEST_ID_BYTES = 256
CONNECTION_ERROR_ID = ""  # an error's request_id when no request of the message is known


class GenerateRequest(
    msgspec.Struct, tag="generate", omit_defaults=True, forbid_unknown_fields=True
):
    """A new request; its id is the envelope's."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = {}
    stream: bool = True  # False: a single GenerateOutput when the request ends


class AbortGenerate(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Stop the request the envelope names (nothing if it is not in flight)."""


class GenerateOutput(msgspec.Struct, tag="output", omit_defaults=True):
    """New tokens and text of a request; `finish_reason` set on its last output."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort"
    prompt_tokens: int = 0  # on the first output
    logprobs: list[float] | None = None  # per token in token_ids, when params.logprobs is set


class GenerateError(msgspec.Struct, tag="error"):
    """The request failed or was refused (HTTP-like status: 400, 401, 429, 503, ...)."""

    request_id: str
    status: int
    message: str


ToFrontendEndpoint = GenerateRequest | AbortGenerate
FromFrontendEndpoint = GenerateOutput | GenerateError


def envelope(api_key: str, request_id: str, body: bytes) -> list[bytes]:
    """A client message's frames; ValueError for a key or an id longer than allowed."""
    key, rid = api_key.encode(), request_id.encode()
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"the API key is longer than {MAX_KEY_BYTES} bytes")
    if not rid or len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"a request id is 1 to {MAX_REQUEST_ID_BYTES} bytes, not {len(rid)}")
    return [PROTOCOL, key, rid, body]


class RequestError(RuntimeError):
    """What the clients raise for a refused or failed request (a GenerateError, or an HTTP
    error status): `status` as HTTP has it (400, 401, 429, 503, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
