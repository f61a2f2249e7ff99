"""`POST /v1/messages/count_tokens` (Anthropic's): the prompt tokens a Messages request
would take, system, tools and template included, without running it. The body is a
Messages request without `max_tokens`; it is translated as `/v1/messages` translates it
(`messages_api.chat_request`) and rendered by the chat template (`chat.chat_prompt`)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from subway.frontend.chat import chat_prompt
from subway.frontend.errors import APIError
from subway.frontend.inputs import Limits, check_model, parse
from subway.frontend.messages_api import chat_request, error_response
from subway.frontend.messages_protocol import MessagesRequest
from subway.frontend.pipeline import ServingContext, engine_failure


def count(body: bytes, tokenizer, limits: Limits) -> tuple[MessagesRequest, int]:
    """The request and its prompt's token count (on a worker thread)."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    data = {**data, "max_tokens": 1, "stream": False}  # not part of a count's body
    req = parse(MessagesRequest, json.dumps(data).encode())
    prompt = chat_prompt(chat_request(req), tokenizer, limits, check_length=False)
    return req, len(prompt.ids)


def add_count_tokens_route(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = await request.body()
            req, n = await ctx.offload.run(count, body, ctx.tokenizer, ctx.limits(),
                                           what="rendering the chat template")  # fmt: skip
            check_model(req, ctx.config, ctx.lora)
            return JSONResponse({"input_tokens": n})
        except Exception as e:
            return error_response(engine_failure(e))
