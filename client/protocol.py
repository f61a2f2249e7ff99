"""The messages of the frontend's native ZMQ endpoint (client DEALER <-> frontend ROUTER).

The one module that both sides import: the clients of `subway.client` and the
frontend's endpoint. It imports only msgspec. Each message is one ZMQ frame of
MessagePack; requests carry the client's own request id, which every answer
repeats.

    client -> frontend : GenerateRequest, AbortGenerate
    frontend -> client : GenerateOutput (one per step, or one at the end), GenerateError

`params` takes the fields of an OpenAI completions request (`max_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`,
`ignore_eos`, penalties, `logprobs`, `skip_special_tokens`, `timeout`,
`priority`, ...), checked as the HTTP endpoint checks them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class GenerateRequest(msgspec.Struct, tag="generate", omit_defaults=True):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = {}
    stream: bool = True  # False: a single GenerateOutput when the request ends
    api_key: str = ""


class AbortGenerate(msgspec.Struct, tag="abort"):
    request_id: str


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


class RequestError(RuntimeError):
    """What the clients raise for a refused or failed request (a GenerateError, or an HTTP
    error status): `status` as HTTP has it (400, 401, 429, 503, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
