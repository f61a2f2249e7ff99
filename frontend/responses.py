"""OpenAI API response models: completions, chat completions (whole and streamed chunks),
errors, tokenize, models. The requests are `protocol.py`'s.

`render_fields` renders a body of long lists or strings (`/tokenize`'s,
`/detokenize`'s) `RENDER_PIECE` items at a time, under a byte limit: each
`json.dumps` call holds the GIL, so one call over millions of items would stall
the event loop even from another thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, Field, model_serializer


def _now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Answer(BaseModel):
    """The fields of every completion body, whole or a streamed chunk, in OpenAI's order;
    each kind names its `object` and its choices."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list
    usage: Usage | None = None


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    """`reasoning_content` (`--reasoning-parser`) is left out unless set, null included."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = []
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_if_set(self, handler):
        out = handler(self)
        if "reasoning_content" not in self.model_fields_set:
            out.pop("reasoning_content", None)
        return out


class _Sparse(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI's stream pieces are."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """One piece of a streamed call: the first names it (`id`, `type`, `function.name`),
    the rest carry more `function.arguments`; the client joins them by `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(_Sparse):
    """Serialized without its unset fields: the last chunk's delta is `{}`, as OpenAI's."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser's
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Answer):
    """One SSE event of a streamed chat completion (`usage` only on the last when asked)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed completion: the same shape as the full response."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "subway"
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


RENDER_PIECE = 65536  # list items or characters one json.dumps call renders at most


class TooLarge(Exception):
    """A body that would pass its byte limit."""


def render_fields(fields: dict[str, object], max_bytes: int = 0) -> bytes:
    """`fields` (strings, numbers, None, lists of them) as a JSON object, as FastAPI's
    JSONResponse renders it; TooLarge past `max_bytes` (0: no limit), before rendering
    the rest."""
    parts, size = [b"{"], 2
    for k, (name, value) in enumerate(fields.items()):
        parts.append((("," if k else "") + json.dumps(name) + ":").encode())
        for piece in _pieces(value):
            size += len(piece) + 1
            if max_bytes and size > max_bytes:
                raise TooLarge(f"more than {max_bytes} bytes")
            parts.append(piece)
    parts.append(b"}")
    return b"".join(parts)


def _pieces(value: object) -> Iterator[bytes]:
    if isinstance(value, list) and len(value) > RENDER_PIECE:
        for i in range(0, len(value), RENDER_PIECE):
            yield (b"," if i else b"[") + _dumps(value[i : i + RENDER_PIECE])[1:-1]
        yield b"]"
    elif isinstance(value, str) and len(value) > RENDER_PIECE:
        yield b'"'
        for i in range(0, len(value), RENDER_PIECE):
            yield _dumps(value[i : i + RENDER_PIECE])[1:-1]
        yield b'"'
    else:
        yield _dumps(value)


def _dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
