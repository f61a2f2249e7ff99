"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`.

A response is a chat request on the one pipeline (`pipeline.start_chat`): its
input items become chat messages (`responses_translate.chat_request`), and the
chat answer, already split into reasoning, text and tool calls by the chat view,
becomes output items: whole, or streamed as the API's semantic events
(`EventStream`: `response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its `sequence_number`. Errors are OpenAI's
shape, as on every other route; one after a stream began is an `error` event,
then `response.failed`.

With `store` (the default) the response and its conversation are kept in memory
(`response_store.py`) for `previous_response_id`, `GET` and `DELETE`; with
`background` the request is answered at once ("in_progress") and polled by id,
and `cancel` aborts its run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from subway.frontend.choices import ClientDisconnected
from subway.frontend.errors import APIError
from subway.frontend.inputs import IGNORED_HEADER, parse
from subway.frontend.pipeline import ChatRun, ServingContext, engine_failure, start_chat
from subway.frontend.response_store import ResponseStore, Stored
from subway.frontend.responses import ChatCompletionChunk, ChatCompletionResponse
from subway.frontend.responses_protocol import ResponsesRequest
from subway.frontend.responses_translate import (
    call_item,
    chat_request,
    input_items,
    message_item,
    new_item_id,
    output_items,
    reasoning_item,
    text_part,
)


class ResponseRun:
    """One response: its request, its id and what it continues; makes its bodies and
    keeps them in the store."""

    def __init__(self, req: ResponsesRequest, store: ResponseStore, history: list[dict],
                 model: str) -> None:  # fmt: skip
        self.req = req
        self.store = store
        self.history = history
        self.model = model
        self.id = new_item_id("resp")
        self.created = int(time.time())
        self.stored = req.store and store.enabled
        self.task: asyncio.Task | None = None  # a background run

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             error: dict | None = None, finish: str | None = None) -> dict:  # fmt: skip
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if finish == "length" else None
            ),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (
                choice or "auto"
            ),
            "tools": req.tools or [],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None,
                                                                          "summary": None},
            "store": self.stored, "background": req.background, "truncation": "disabled",
            "user": req.user,
        }  # fmt: skip

    def keep(self, body: dict) -> None:
        """The response's state into the store (when it is stored)."""
        if not self.stored:
            return
        items = input_items(self.req)
        history = self.history + items + list(body["output"])
        self.store.put(Stored(response=body, history=history, input_items=items, task=self.task))

    def finished(self, chat: ChatCompletionResponse) -> dict:
        """The whole response from the whole chat answer, kept."""
        finish = chat.choices[0].finish_reason
        body = self.body(_status(finish), output_items(chat),
                         usage(chat.usage.prompt_tokens, chat.usage.completion_tokens),
                         finish=finish)  # fmt: skip
        self.keep(body)
        return body


def usage(prompt: int, completion: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _status(finish: str | None) -> str:
    """A response's status from its chat finish: cut short (its length, a time limit) is
    "incomplete"."""
    return "incomplete" if finish in ("length", "abort") else "completed"


class EventStream:
    """A streamed response's events from its chat chunks: each output item is opened when
    its first piece comes (reasoning, text or a call) and closed, with its `.done`
    events, when a piece of another item or the end comes."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text or arguments so far
        self.finish: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(fields, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        body = self.run.body("in_progress", [])
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]  # fmt: skip

    def feed(self, chunk: ChatCompletionChunk) -> list[str]:
        if chunk.usage is not None:
            self.usage = usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        if not chunk.choices:
            return []
        choice = chunk.choices[0]
        delta, events = choice.delta, []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            if call.function is None:
                continue
            if call.function.name is not None:
                events += self._close()
                item = call_item(new_item_id("fc"), call.id or "", call.function.name, "",
                                 "in_progress")  # fmt: skip
                events += self._open(item)
            if call.function.arguments:
                events += self._piece("response.function_call_arguments.delta",
                                      call.function.arguments)  # fmt: skip
        if choice.finish_reason is not None:
            self.finish = choice.finish_reason
            events += self._close()
        return events

    def end(self) -> list[str]:
        events = self._close()
        status = _status(self.finish)
        body = self.run.body(status, self.output, self.usage, finish=self.finish)
        self.run.keep(body)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=body)]

    def failed(self, e: APIError) -> list[str]:
        events = self._close()
        events.append(self.event("error", code=str(e.status), message=e.message, param=e.param))
        error = {"code": "server_error" if e.status >= 500 else "invalid_request",
                 "message": e.message}  # fmt: skip
        body = self.run.body("failed", self.output, self.usage, error)
        self.run.keep(body)
        return events + [self.event("response.failed", response=body)]

    def _text(self, kind: str, piece: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            opened = reasoning_item if kind == "reasoning" else message_item
            events += self._open(opened(new_item_id("rs" if kind == "reasoning" else "msg"),
                                        None, "in_progress"))  # fmt: skip
            part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self._at("response.content_part.added", content_index=0, part=part))
        delta = "response.output_text.delta" if kind == "message" else (
            "response.reasoning_text.delta")  # fmt: skip
        extra = {"logprobs": []} if kind == "message" else {}
        return events + self._piece(delta, piece, content_index=0, **extra)

    def _open(self, item: dict) -> list[str]:
        self.open, self.text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=item)]  # fmt: skip

    def _piece(self, kind: str, piece: str, **fields) -> list[str]:
        self.text += piece
        return [self._at(kind, delta=piece, **fields)]

    def _at(self, kind: str, **fields) -> str:
        assert self.open is not None
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output), **fields)

    def _close(self) -> list[str]:
        item, text = self.open, self.text
        if item is None:
            return []
        if item["type"] == "function_call":
            done = call_item(item["id"], item["call_id"], item["name"], text)
            events = [self._at("response.function_call_arguments.done", name=item["name"],
                               arguments=text)]  # fmt: skip
        elif item["type"] == "message":
            done, part = message_item(item["id"], text), text_part(text)
            events = [self._at("response.output_text.done", content_index=0, text=text,
                               logprobs=[]),
                      self._at("response.content_part.done", content_index=0, part=part)]  # fmt: skip
        else:
            done = reasoning_item(item["id"], text)
            part = {"type": "reasoning_text", "text": text}
            events = [self._at("response.reasoning_text.done", content_index=0, text=text),
                      self._at("response.content_part.done", content_index=0, part=part)]  # fmt: skip
        events.append(self._at("response.output_item.done", item=done))
        self.output.append(done)
        self.open, self.text = None, ""
        return events


async def _events(stream: EventStream, run: ChatRun) -> AsyncIterator[str]:
    for e in stream.start():
        yield e
    try:
        async for chunk in run.view.chunks(run.group):
            for e in stream.feed(chunk):
                yield e
    except ClientDisconnected:
        return
    except Exception as e:  # the stream has begun: the error is its last events
        for ev in stream.failed(engine_failure(e)):
            yield ev
        return
    finally:
        run.close()
    for e in stream.end():
        yield e


async def _whole(run: ResponseRun, chat: ChatRun) -> dict:
    try:
        return run.finished(await chat.view.whole(chat.group))
    finally:
        chat.close()


async def _background(run: ResponseRun, chat: ChatRun) -> None:
    """A background response's run: its end (completed, failed or cancelled) is kept."""
    try:
        await _whole(run, chat)
    except asyncio.CancelledError:
        run.keep(run.body("cancelled", []))
        raise
    except Exception as e:
        err = engine_failure(e)
        run.keep(run.body("failed", [], error={"code": "server_error", "message": err.message}))


async def create(ctx: ServingContext, store: ResponseStore, request: Request) -> Response:
    body = await request.body()
    req = await ctx.offload.run(parse, ResponsesRequest, body, what="parsing the request body")
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None or (prev.task is not None and not prev.task.done()):
            state = "is still in progress" if prev is not None else "was not found"
            raise APIError(400, f"previous response {req.previous_response_id!r} {state}",
                           "previous_response_id")  # fmt: skip
        history = prev.history
    model = req.model or ctx.config.model.served_model_name
    run = ResponseRun(req, store, history, model)
    chat = await ctx.offload.run(chat_request, req, history, req.stream,
                                 what="translating the input")  # fmt: skip
    try:
        started = await start_chat(ctx, chat, run.id, None if req.background else request)
    except APIError as e:
        if e.param is not None and e.param.startswith("messages"):
            e.param = "input"  # the chat request's field is the input here
        raise
    headers = {IGNORED_HEADER: ", ".join(started.ignored)} if started.ignored else None
    if req.background:
        body = run.body("in_progress", [])
        run.task = asyncio.get_running_loop().create_task(_background(run, started))
        run.keep(body)
        return JSONResponse(body, headers=headers)
    if req.stream:
        return StreamingResponse(_events(EventStream(run), started),
                                 media_type="text/event-stream", headers=headers)  # fmt: skip
    try:
        answer = await _whole(run, started)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    return JSONResponse(answer, headers=headers)


def _stored(store: ResponseStore, rid: str) -> Stored:
    entry = store.get(rid)
    if entry is None:
        raise APIError(404, f"no response {rid!r} is stored", "response_id")
    return entry


def add_responses_routes(app: FastAPI, ctx: ServingContext) -> ResponseStore:
    """The Responses API's routes, with their store (returned)."""
    server = ctx.config.server
    store = ResponseStore(server.responses_store_max, server.responses_store_bytes,
                          server.responses_store_ttl)  # fmt: skip

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create(ctx, store, request)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str) -> Response:
        return JSONResponse(_stored(store, rid).response)

    @app.get("/v1/responses/{rid}/input_items")
    async def get_input_items(rid: str) -> Response:
        items = _stored(store, rid).input_items
        return JSONResponse({"object": "list", "data": items, "has_more": False})

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str) -> Response:
        entry = _stored(store, rid)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.wait([entry.task])  # its end is kept, then removed here
        store.remove(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel_response(rid: str) -> Response:
        entry = _stored(store, rid)
        task = entry.task
        if task is None:
            raise APIError(400, "only a background response can be cancelled", "response_id")
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
        return JSONResponse(_stored(store, rid).response)

    return store
