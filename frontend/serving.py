"""What both generation endpoints share: request parsing, checks, SSE framing, logprobs."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from subway.frontend.engine_client import EngineClient, EngineDeadError, QueueFullError
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.generation import AccessRecord, GenerationError, TokenLogprob
from subway.frontend.inputs import Limits
from subway.frontend.metrics import Metrics
from subway.frontend.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    SamplingRequest,
    TopLogprob,
)
from subway.ipc.config import EngineConfig

R = TypeVar("R", bound=BaseModel)


@dataclass
class ServingContext:
    config: EngineConfig
    engine: EngineClient
    tokenizer: object
    metrics: Metrics | None = None

    def limits(self) -> Limits:
        info = self.engine.info
        if info is None or not self.engine.ready:
            raise APIError(503, self.engine.error or "the engine is not ready yet")
        return Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def timeout(self, requested: float | None) -> float | None:
        """The request's time limit: its own `timeout`, at most the server's (0: none)."""
        server = self.config.server.request_timeout or None
        if requested is None:
            return server
        return min(requested, server) if server else requested


def access_record(request, request_id: str, prompt_tokens: int) -> AccessRecord:
    """The access-log record of this HTTP request (the middleware logs it when it ends)."""
    record = request.scope.get("subway.access")
    if not isinstance(record, AccessRecord):
        record = AccessRecord()
        request.scope["subway.access"] = record
    record.request_id = request_id
    record.prompt_tokens = prompt_tokens
    return record


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def parse(model: type[R], body: bytes) -> R:
    """Parse a JSON body; anything wrong is a 400 (json.loads first: pydantic takes NaN literals)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _check_text(obj, depth: int = 0) -> None:
    """Reject what JSON allows but text cannot be: lone UTF-16 surrogates (`"\\ud800"`)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, "the request holds a string that is not valid Unicode") from e
    elif depth > 64:
        raise APIError(400, "the request body is nested too deeply")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_text(k, depth + 1)
            _check_text(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_text(v, depth + 1)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def check_model(req: SamplingRequest, config: EngineConfig) -> None:
    if req.model is not None and req.model != config.model.served_model_name:
        raise APIError(404, f"the model `{req.model}` does not exist", "model")


def engine_failure(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine cannot serve: {e}")
    if isinstance(e, GenerationError):
        return APIError(500, str(e))
    return APIError(500, f"internal error: {e!r}")


def sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_error(e: Exception) -> AsyncIterator[str]:
    yield f"data: {engine_failure(e).body().model_dump_json()}\n\n"
    yield SSE_DONE


def completion_logprobs(
    ctx: ServingContext, lps: list[TokenLogprob], offset: int
) -> CompletionLogprobs:
    """Legacy completions logprobs; `offset`: where these tokens' text starts in the choice.

    As OpenAI's (and vLLM's): `top_logprobs` holds the top alternatives and the
    chosen token; a token without a logprob (a prompt's first) has None for both.
    """
    out = CompletionLogprobs()
    for lp in lps:
        token = ctx.token_text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        if lp.logprob is None or lp.top is None:
            out.top_logprobs.append(None)
        else:
            top = {ctx.token_text(t): v for t, v in lp.top}
            top.setdefault(token, lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float | None) -> TopLogprob:
        token = ctx.token_text(token_id)
        value = -9999.0 if logprob is None else logprob
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **top(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[top(t, v) for t, v in (lp.top or [])],
            )
            for lp in lps
        ]
    )
