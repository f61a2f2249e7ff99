"""The frontend's guard at the door: API key, size limits, access log. Pure ASGI.

A plain ASGI wrapper rather than Starlette's BaseHTTPMiddleware, which gets in
the way of streaming responses and of disconnect detection. In order:

- headers larger than `max_header_bytes` in all: 431;
- with an API key, every route but `/health` wants `Authorization: Bearer KEY`
  or `x-api-key: KEY` (Anthropic's clients send that), compared in constant
  time: 401 otherwise (unknown routes included, so that they reveal nothing);
- a body larger than `max_body_bytes` (by Content-Length, or counted as it
  arrives): 413. A declared oversize body is read and dropped first (up to a
  bound) so that the client, still sending, sees the answer;
- a body that has not all come `body_timeout` seconds after the headers: 408,
  and the connection is closed (`Connection: close`). Once the body is in,
  `receive` has no deadline (it then only waits for the client to go away). The
  headers' own timeout and the connection limit are the protocol's
  (`http_limits.py`);
- the errors it answers itself are in the OpenAI shape, and in Anthropic's on
  the Messages API's paths (`/v1/messages...`);
- one structured access-log line per request, on logger `subway.access`:
  method, path, status, id, prompt and output tokens, TTFT, latency, finish
  reasons (JSON). `/health` and `/metrics` log at DEBUG, the rest at INFO.

The middleware makes each request's `AccessRecord` and logs it when the
request ends. The route takes it once, with `access_record()` (a context
variable that the middleware sets for the request's task: no key in the ASGI
scope), and from there it is an argument of whatever fills it in (ids and
token counts, then each event). The native ZMQ endpoint logs its requests with
the same record and fields.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from subway.frontend.errors import APIError
from subway.frontend.messages_protocol import error_bytes as anthropic_error_bytes
from subway.frontend.messages_protocol import is_messages_path

if TYPE_CHECKING:
    from subway.frontend.choices import ChoiceEvent

access_log = logging.getLogger("subway.access")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024
DRAIN_LIMIT = 64 * 1024 * 1024  # a declared oversize body is drained up to this, then cut
QUIET_PATHS = ("/health", "/metrics")


@dataclass
class AccessRecord:
    """What the access log says about one API request (filled in by its handler)."""

    request_id: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    def note(self, event: ChoiceEvent) -> None:
        self.output_tokens += len(event.token_ids)
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        if event.finish_reason is not None:
            self.finish_reasons.append(event.finish_reason)

    def fields(self, start: float) -> dict:
        """The line's fields about the API request (none if it never got that far)."""
        if not self.request_id:
            return {}
        ttft = None if self.first_token_at is None else self.first_token_at - start
        reasons = self.finish_reasons
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "finish_reason": reasons[0] if len(set(reasons)) == 1 else reasons or None,
        }


def log_access(level: int, line: dict) -> None:
    access_log.log(level, json.dumps(line, separators=(",", ":")))


_current_record: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "subway_access_record", default=None
)


def access_record() -> AccessRecord:
    """The record of the HTTP request being served (a loose one outside the middleware)."""
    return _current_record.get() or AccessRecord()


class GuardMiddleware:
    def __init__(
        self,
        app,
        api_key: str = "",
        max_body_bytes: int = MAX_BODY_BYTES,
        max_header_bytes: int = MAX_HEADER_BYTES,
        body_timeout: float = 0.0,
    ) -> None:
        """`body_timeout`: seconds the body may take after the headers (0: no limit)."""
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None  # `x-api-key`'s
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.time()
        record = AccessRecord()
        token = _current_record.set(record)
        status = {"code": 0}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        receive = self._timed(receive)
        try:
            error = self._check(scope)
            if error is None:
                length = _content_length(scope)
                if length is not None and length > self.max_body:
                    try:
                        await _drain(receive, min(length, DRAIN_LIMIT))
                    except APIError as e:  # too slow even to drain: say so and close
                        error = e
                    else:
                        error = APIError(
                            413, f"the request body is larger than {self.max_body} bytes"
                        )
            if error is not None:
                await _send_error(send_wrapper, error, is_messages_path(scope.get("path") or ""))
                return
            await self.app(scope, self._limited(receive), send_wrapper)
        except Exception:
            status["code"] = status["code"] or 500  # the server's error handler answers
            raise
        finally:
            _current_record.reset(token)
            self._log(scope, status["code"], record, start)

    def _check(self, scope) -> APIError | None:
        headers = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.max_headers:
            return APIError(431, f"the request headers are larger than {self.max_headers} bytes")
        if self.expected is not None and scope.get("path") != "/health":
            given = {b"authorization": b"", b"x-api-key": b""}
            for k, v in headers:
                if k in given and not given[k]:
                    given[k] = v
            bearer = hmac.compare_digest(given[b"authorization"], self.expected)
            key = hmac.compare_digest(given[b"x-api-key"], self.key or b"")
            if not (bearer or key):
                return APIError(
                    401,
                    "invalid or missing API key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None

    def _timed(self, receive):
        """`receive` under the body's deadline (408) until the body's last part has come."""
        timeout = self.body_timeout
        deadline = asyncio.get_running_loop().time() + timeout if timeout > 0 else None

        async def wrapped():
            nonlocal deadline
            if deadline is None:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {timeout:g} s",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                deadline = None  # all in: from now on receive waits for a disconnect
            return message

        return wrapped

    def _limited(self, receive):
        seen = 0
        limit = self.max_body

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # the app's handler for APIError answers
                    raise APIError(413, f"the request body is larger than {limit} bytes")
            return message

        return wrapped

    @staticmethod
    def _log(scope, status: int, record: AccessRecord, start: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not access_log.isEnabledFor(level):
            return
        line = {
            "method": scope.get("method"),
            "path": path,
            "status": status or 499,
            "client": (scope.get("client") or ("", 0))[0],
            "latency_s": round(time.time() - start, 6),
        }
        log_access(level, line | record.fields(start))


def _content_length(scope) -> int | None:
    for k, v in scope.get("headers") or []:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


async def _drain(receive, limit: int) -> None:
    seen = 0
    while seen < limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _send_error(send, error: APIError, anthropic: bool = False) -> None:
    body = anthropic_error_bytes(error) if anthropic else error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (error.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
