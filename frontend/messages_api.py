"""Anthropic's Messages API (`POST /v1/messages`), as vLLM and llama.cpp's server serve it,
on the chat pipeline: a Messages request becomes a chat request (`chat_request`), runs
through `pipeline.start_chat` like any chat completion (LoRA adapters by `model`,
tools, `--reasoning-parser`, structured outputs), and its chat answer becomes a
Messages answer, whole (`to_message`) or as Anthropic's stream of events
(`EventStream`).

- The system prompt is a system message; an assistant's `tool_use` blocks are its
  `tool_calls`; a user's `tool_result` blocks are `tool` messages, before the rest of
  that user message's text; a last assistant message with text is continued (a
  prefill), as Anthropic's API does.
- tool_choice auto, any, tool and none are chat's "auto", "required", a named function
  and "none"; `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- `output_config.format` (a JSON schema) is a structured output, as vLLM's
  `structured_outputs` (also taken) are.
- `thinking` is the chat template's `enable_thinking`; the chat answer's
  `reasoning_content` (`--reasoning-parser`) is a `thinking` block, first.
- A call whose arguments are not a JSON object is answered as a text block.
- `stop_reason` "stop_sequence" and its `stop_sequence`: the engine's events do not
  say which stop string ended an output, so a request with stop sequences asks the
  chat pipeline to keep the one that stopped it in the text
  (`include_stop_str_in_output`); the answer's text ends with it, and it is cut off
  here (streamed, the open block holds back its last characters until the end).

Every error on these routes is in Anthropic's shape (`messages_protocol.error_body`);
after a stream has started, an `error` event ends it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from subway.frontend.choices import ClientDisconnected
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.inputs import IGNORED_HEADER, parse
from subway.frontend.messages_protocol import (
    Message,
    MessageParam,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    error_body,
    stop_reason,
)
from subway.frontend.pipeline import ChatRun, ServingContext, engine_failure, start_chat
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.responses import ChatCompletionChunk, ChatCompletionResponse, DeltaToolCall
from subway.frontend.tool_parsers import MAX_JSON_DEPTH, json_depth

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def new_tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- the request


def read_request(body: bytes) -> tuple[MessagesRequest, ChatCompletionRequest]:
    """A request body, parsed and made the chat request that runs it (on a worker thread)."""
    req = parse(MessagesRequest, body)
    return req, chat_request(req)


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req`; 400 for what cannot be translated."""
    messages, prefill = chat_messages(req)
    stops = req.stops()
    fields: dict = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stop": stops or None,
        "include_stop_str_in_output": bool(stops),  # to tell which one stopped it
        "stream": req.stream,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
    }
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    structured = structured_outputs(req)
    if structured is not None:
        fields["structured_outputs"] = structured
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.enabled
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    fields.update(chat_tools(req))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise from_validation_error(e) from e


def structured_outputs(req: MessagesRequest) -> dict | None:
    """vLLM's `structured_outputs`, or Anthropic's `output_config.format` as one."""
    output = req.output_config.format if req.output_config is not None else None
    if output is None:
        return req.structured_outputs
    if req.structured_outputs is not None:
        raise APIError(400, "give structured_outputs or output_config.format, not both",
                       "output_config.format")  # fmt: skip
    return {"json": output.schema_}


def chat_messages(req: MessagesRequest) -> tuple[list[dict], bool]:
    """The conversation as chat messages, and whether the last (an assistant's text) is
    to be continued. A last assistant message with no text (thinking alone) is dropped."""
    out: list[dict] = []
    system = "\n".join(b.text for b in req.system or ())
    if system:
        out.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use id -> the tool's name, of the calls so far
    for i, m in enumerate(req.messages):
        if m.role == "assistant":
            out.append(_assistant_message(m, i, calls))
        else:
            out.extend(_user_messages(m, i, calls))
    prefill = req.messages[-1].role == "assistant"
    if prefill and out[-1]["tool_calls"]:
        raise APIError(
            400,
            "the last message is the assistant's tool_use: send its tool_result in a user message",
            f"messages.{len(req.messages) - 1}.content",
        )
    if prefill and not out[-1]["content"]:
        out.pop()
        prefill = False
    return out, prefill


def _assistant_message(m: MessageParam, i: int, calls: dict[str, str]) -> dict:
    texts, tool_calls = [], []
    for block in m.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls[block.id] = block.name
            arguments = json.dumps(block.input, ensure_ascii=False)
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
        elif isinstance(block, ToolResultBlock):
            raise APIError(400, "tool_result blocks belong in user messages",
                           f"messages.{i}.content")  # fmt: skip
    text = "\n".join(texts)
    content = text if text or not tool_calls else None
    return {"role": "assistant", "content": content, "tool_calls": tool_calls or None}


def _user_messages(m: MessageParam, i: int, calls: dict[str, str]) -> list[dict]:
    """A user message: a `tool` message per tool_result, then its text (if any)."""
    out, texts = [], []
    for block in m.content:
        if isinstance(block, ToolResultBlock):
            name = calls.get(block.tool_use_id)
            if name is None:
                raise APIError(
                    400,
                    f"tool_result names tool_use_id {block.tool_use_id[:64]!r}, which no "
                    "earlier tool_use block has",
                    f"messages.{i}.content",
                )
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "name": name,
                        "content": block.text()})  # fmt: skip
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            raise APIError(400, "tool_use blocks belong in assistant messages",
                           f"messages.{i}.content")  # fmt: skip
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(req: MessagesRequest) -> dict:
    """The chat request's `tools`, `tool_choice` and `parallel_tool_calls`."""
    fields: dict = {}
    if req.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}}
            for t in req.tools
        ]  # fmt: skip
    choice = req.tool_choice
    if choice is None:
        return fields
    if choice.type == "tool":
        if choice.name not in {t.name for t in req.tools or ()}:
            raise APIError(400, f"tool_choice names {choice.name[:64]!r}, which is not a tool",
                           "tool_choice.name")  # fmt: skip
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = TOOL_CHOICES[choice.type]
    fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


# ---------------------------------------------------------------- the answer


def cut_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` without the stop sequence it ends with (the longest, as the detokenizer
    matches the earliest start), and that sequence; None if it ends with none."""
    for stop in sorted(stops, key=len, reverse=True):
        if text.endswith(stop):
            return text[: len(text) - len(stop)], stop
    return text, None


def tool_block(name: str, arguments: str) -> ToolUseBlock | TextBlock:
    """A call as a `tool_use` block; arguments that are not a JSON object, as text."""
    if not arguments.strip():
        return ToolUseBlock(id=new_tool_id(), name=name, input={})
    value = None
    if json_depth(arguments) <= MAX_JSON_DEPTH:
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if isinstance(value, dict):
        return ToolUseBlock(id=new_tool_id(), name=name, input=value)
    return TextBlock(text=arguments)


def to_message(resp: ChatCompletionResponse, req: MessagesRequest, msg_id: str) -> Message:
    """A whole chat answer (one choice) as a Messages answer."""
    choice = resp.choices[0]
    message = choice.message
    reasoning, text, calls = (
        message.reasoning_content or "",
        message.content or "",
        message.tool_calls,
    )
    reason, matched = stop_reason(choice.finish_reason), None
    if choice.finish_reason == "stop" and req.stops():  # the output ends with the stop
        if text:
            text, matched = cut_stop(text, req.stops())
        elif not calls:
            reasoning, matched = cut_stop(reasoning, req.stops())
    blocks: list = [ThinkingBlock(thinking=reasoning)] if reasoning else []
    if text:
        blocks.append(TextBlock(text=text))
    blocks += [tool_block(c.function.name, c.function.arguments) for c in calls]
    usage = MessageUsage(
        input_tokens=resp.usage.prompt_tokens if resp.usage else 0,
        output_tokens=resp.usage.completion_tokens if resp.usage else 0,
    )
    return Message(id=msg_id, model=resp.model, content=blocks, usage=usage,
                   stop_reason="stop_sequence" if matched else reason, stop_sequence=matched)  # fmt: skip


def sse_event(kind: str, data: dict) -> str:
    body = json.dumps({"type": kind, **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n"


class EventStream:
    """One streamed answer: chat chunks in, Messages API events out.

    A block opens when the chunks switch kind (reasoning: `thinking`, content: `text`,
    each call: its `tool_use`, its arguments as `input_json_delta`) and closes when the
    next opens or the answer ends. With stop sequences, the open text or thinking block
    holds back its last characters (as many as the longest sequence) until more come or
    the answer ends, where the one that stopped it is cut off."""

    def __init__(self, msg_id: str, model: str, input_tokens: int, stops: list[str]) -> None:
        self.msg_id, self.model, self.stops = msg_id, model, stops
        self.keep = max((len(s) for s in stops), default=0)
        self.index = -1  # of the last block opened
        self.kind: str | None = None  # of the open block: "thinking", "text", "tool_use"
        self.tail = ""  # the open block's text held back
        self.finish: str | None = None  # chat's finish_reason
        self.usage = MessageUsage(input_tokens=input_tokens)

    def start(self) -> str:
        message = Message(id=self.msg_id, model=self.model, usage=self.usage)
        return sse_event("message_start", {"message": message.model_dump()}) + sse_event("ping", {})

    def feed(self, chunk: ChatCompletionChunk) -> str:
        out: list[str] = []
        if chunk.usage is not None:
            self.usage.input_tokens = chunk.usage.prompt_tokens
            self.usage.output_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            self._text("thinking", delta.reasoning_content, out)
            self._text("text", delta.content, out)
            for piece in delta.tool_calls or ():
                self._call(piece, out)
            self.finish = choice.finish_reason or self.finish
        return "".join(out)

    def end(self) -> str:
        out: list[str] = []
        reason, matched = stop_reason(self.finish), None
        if self.finish == "stop" and self.kind in ("text", "thinking") and self.stops:
            self.tail, matched = cut_stop(self.tail, self.stops)
        self._close(out)
        delta = {"stop_reason": "stop_sequence" if matched else reason, "stop_sequence": matched}
        out.append(sse_event("message_delta", {"delta": delta, "usage": self.usage.model_dump()}))
        out.append(sse_event("message_stop", {}))
        return "".join(out)

    def _open(self, kind: str, block: dict, out: list[str]) -> None:
        self._close(out)
        self.index += 1
        self.kind = kind
        out.append(sse_event("content_block_start", {"index": self.index, "content_block": block}))

    def _close(self, out: list[str]) -> None:
        if self.kind is None:
            return
        if self.tail:
            self._delta(self.tail, out)
            self.tail = ""
        out.append(sse_event("content_block_stop", {"index": self.index}))
        self.kind = None

    def _delta(self, text: str, out: list[str]) -> None:
        if self.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        elif self.kind == "text":
            delta = {"type": "text_delta", "text": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        out.append(sse_event("content_block_delta", {"index": self.index, "delta": delta}))

    def _text(self, kind: str, text: str | None, out: list[str]) -> None:
        if not text:
            return
        if self.kind != kind:
            block = ThinkingBlock() if kind == "thinking" else TextBlock(text="")
            self._open(kind, block.model_dump(), out)
        buf = self.tail + text
        cut = max(0, len(buf) - self.keep)
        self.tail = buf[cut:]
        if cut:
            self._delta(buf[:cut], out)

    def _call(self, piece: DeltaToolCall, out: list[str]) -> None:
        """A piece of a call: the first names it (a new block), the rest add arguments."""
        fn = piece.function
        if fn is None:
            return
        if fn.name is not None:
            block = {"type": "tool_use", "id": new_tool_id(), "name": fn.name, "input": {}}
            self._open("tool_use", block, out)
        if fn.arguments and self.kind == "tool_use":
            self._delta(fn.arguments, out)


# ---------------------------------------------------------------- the routes


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


async def serve_messages(ctx: ServingContext, request: Request) -> Response:
    """One `/v1/messages` request, start to end; refusals raise APIError."""
    body = await request.body()
    req, chat = await ctx.offload.run(read_request, body, what="parsing the request body")
    msg_id = f"msg_{uuid.uuid4().hex}"
    run = await start_chat(ctx, chat, msg_id, request)
    headers = {IGNORED_HEADER: ", ".join(run.ignored)} if run.ignored else None
    if req.stream:
        stream = EventStream(msg_id, run.view.model, run.view.job.prompt_tokens, req.stops())
        return StreamingResponse(
            answer_events(run, stream), media_type="text/event-stream", headers=headers
        )
    try:
        answer = await run.view.whole(run.group)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    finally:
        run.close()
    content = await asyncio.to_thread(lambda: to_message(answer, req, msg_id).model_dump_json())
    return Response(content, media_type="application/json", headers=headers)


async def answer_events(run: ChatRun, stream: EventStream) -> AsyncIterator[str]:
    """The streamed answer's events; a failure once it has started is its last event."""
    try:
        yield stream.start()
        async for chunk in run.view.chunks(run.group):
            events = stream.feed(chunk)
            if events:
                yield events
        yield stream.end()
    except ClientDisconnected:
        return  # nobody is listening
    except Exception as e:
        yield sse_event("error", {"error": error_body(engine_failure(e))["error"]})
    finally:
        run.close()


def add_messages_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`POST /v1/messages`; its other methods are 405s in Anthropic's shape."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            return await serve_messages(ctx, request)
        except (ClientDisconnect, ClientDisconnected):
            return Response(status_code=499)
        except Exception as e:  # APIError, or a failure to run it (`engine_failure`)
            return error_response(engine_failure(e))

    @app.api_route("/v1/messages", methods=["GET", "PUT", "PATCH", "DELETE"])
    async def other_methods(request: Request) -> Response:
        return error_response(
            APIError(
                405, f"{request.method} is not allowed: POST a message", headers={"Allow": "POST"}
            )  # fmt: skip
        )
