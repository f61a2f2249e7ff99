"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from subway.frontend.responses import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a request's handling; turned into an error response by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)

    def json_bytes(self) -> bytes:
        return self.body().model_dump_json().encode()


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first offending field."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    message = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {message}")
    return APIError(400, f"{loc}: {message}" if loc else message, param=loc or None)


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}")


def public_reason(text: str, limit: int = 200) -> str:
    """What a client may see of an internal failure: its first line, without file paths,
    at most `limit` characters. The logs keep the whole text."""
    lines = text.strip().splitlines()
    line = _PATH.sub("<path>", lines[0]) if lines else "engine error"
    return line[:limit]
