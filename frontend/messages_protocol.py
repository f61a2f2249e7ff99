"""Anthropic's Messages API models (`POST /v1/messages`): the request, the answer, the
error body. `messages_api.py` translates them to and from chat completions.

Requests are read as `protocol.py`'s are: strict JSON types, no NaN or infinities,
unknown fields ignored (`cache_control` on blocks, tools and the system prompt,
`metadata`'s contents, the fields of Anthropic's own tools and services). A block
list may be a string (one text block). Blocks of a type this server cannot take
(`image`, `document`, ...) and unknown types are 400s that name them, before
pydantic tries each kind. `thinking` and `redacted_thinking` blocks are read and
dropped: the next turn's prompt holds no earlier thinking.

Anthropic's structured outputs (`output_config.format`, a JSON schema) are taken;
vLLM's extensions are accepted too: `structured_outputs` (passed to the chat
request as it is), `seed`, `chat_template_kwargs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from subway.frontend.errors import APIError
from subway.frontend.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)

# Block types of Anthropic's API that carry what a text model cannot read, or that only
# Anthropic's own servers make.
UNSUPPORTED_BLOCKS = frozenset(
    {"image", "document", "search_result", "container_upload", "server_tool_use",
     "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
     "mcp_tool_use", "mcp_tool_result"}
)  # fmt: skip
MESSAGE_BLOCKS = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"})
TEXT_ONLY = frozenset({"text"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def as_blocks(value: object, allowed: frozenset[str]) -> object:
    """`value` as a list of blocks (a string is one text block); a block of a type outside
    `allowed` is an error that names it. Anything else is left to pydantic to refuse."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind in allowed:
            continue
        if kind in UNSUPPORTED_BLOCKS or kind in MESSAGE_BLOCKS:
            raise ValueError(f"block {i}: {kind} blocks are not supported here")
        names = ", ".join(sorted(allowed))
        raise ValueError(f"block {i}: unknown block type {kind[:64]!r} (one of {names})")
    return value


# ---------------------------------------------------------------- blocks


class TextBlock(_Model):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(_Model):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""  # Anthropic's seal of its own thinking; none here


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str = ""


class ToolUseBlock(_Model):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict


class ToolResultBlock(_Model):
    """A tool's answer to the call `tool_use_id`; `is_error` is read and not shown."""

    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: list[TextBlock] = []
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v):
        return [] if v is None else as_blocks(v, TEXT_ONLY)

    def text(self) -> str:
        return "\n".join(b.text for b in self.content)


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v):
        return as_blocks(v, MESSAGE_BLOCKS)


# ---------------------------------------------------------------- the request


class ToolDefinition(_Model):
    """A client tool (Anthropic's own server tools, with a versioned `type`, are refused)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s name')
        return self


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # read; not enforced

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class OutputFormat(_Model):
    model_config = ConfigDict(
        extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True
    )
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Model):
    """Anthropic's structured outputs (`format`); `effort` is read and not used."""

    format: OutputFormat | None = None


class MessagesRequest(_Model):
    model: str
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)  # Anthropic's: 0..1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    stream: bool = False
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None  # read, not used
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # vLLM's extensions
    structured_outputs: dict | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    chat_template_kwargs: dict | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, v):
        return v if v is None else as_blocks(v, TEXT_ONLY)

    @field_validator("stop_sequences")
    @classmethod
    def _few_stops(cls, v):
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in v or ()):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    def stops(self) -> list[str]:
        return [s for s in self.stop_sequences or () if s]


# ---------------------------------------------------------------- the answer


class MessageUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage = MessageUsage()


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish: str | None) -> str | None:
    """A chat finish_reason as a Messages stop_reason (a request's time limit, "abort",
    ends a turn as nothing better says)."""
    return None if finish is None else STOP_REASONS.get(finish, "end_turn")


# ---------------------------------------------------------------- errors

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(e: APIError) -> dict:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_bytes(e: APIError) -> bytes:
    return json.dumps(error_body(e), ensure_ascii=False).encode()


def is_messages_path(path: str) -> bool:
    """Whether `path` is the Messages API's, whose errors are in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_json(e: APIError, path: str) -> JSONResponse:
    """`e` as the response of a request to `path`: Anthropic's shape on the Messages API's
    paths, OpenAI's elsewhere."""
    if is_messages_path(path):
        return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)
    return e.response()
