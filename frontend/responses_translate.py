"""The Responses API in chat's terms: a request's input items become chat messages
(`chat_request`), and a chat answer becomes output items (`output_items`).

Every item is checked where it is read, and a bad one is a 400 naming its place
(`input[3].call_id`). Item types: `message` (roles user, assistant, system,
developer; text parts `input_text`, `output_text`, `refusal`), `function_call`,
`function_call_output` (its `call_id` must name an earlier call) and `reasoning`
(dropped: the chat templates drop earlier thinking too). Images, files and the
hosted tools (web search, file search, ...) are not supported: 400.
"""

from __future__ import annotations

import uuid

from pydantic import ValidationError

from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.responses import ChatCompletionResponse
from subway.frontend.responses_protocol import (
    FunctionTool,
    NamedFunctionChoice,
    ResponsesRequest,
)

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's own input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def chat_request(req: ResponsesRequest, history: list[dict], stream: bool) -> ChatCompletionRequest:
    """The chat request that runs `req`, after the conversation `history` (the items of
    the response it continues, if any)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += chat_messages(history, "previous_response_id")
    messages += chat_messages(input_items(req), "input", _call_ids(history))
    if not messages:
        raise APIError(400, "input holds no message", "input")
    body: dict = {
        "messages": messages,
        "model": req.model,
        "stream": stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "priority": req.priority,
        "ignore_eos": req.ignore_eos,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "timeout",
                 "repetition_penalty"):  # fmt: skip
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, NamedFunctionChoice)
            else choice
        )
    body |= _text_format(req)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _text_format(req: ResponsesRequest) -> dict:
    if req.structured_outputs is not None:
        return {"structured_outputs": req.structured_outputs.model_dump(by_alias=True)}
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _tool(tool: dict, i: int) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(400, f"tools of type {kind!r} are not supported: only function tools",
                       f"tools[{i}].type")  # fmt: skip
    try:
        fn = FunctionTool.model_validate(tool)
    except ValidationError as e:
        err = from_validation_error(e)
        raise APIError(400, f"tools[{i}]: {err.message}", f"tools[{i}]") from e
    definition = {"name": fn.name, "description": fn.description, "parameters": fn.parameters}
    return {"type": "function", "function": definition}


def _call_ids(items: list[dict]) -> set[str]:
    return {i["call_id"] for i in items if i.get("type") == "function_call"}


def chat_messages(items: list[dict], where: str, calls: set[str] | None = None) -> list[dict]:
    """Chat messages from input items; `calls`: the call ids made before these items."""
    calls = set(calls or ())
    messages: list[dict] = []
    for i, item in enumerate(items):
        place = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{place} is not an object", place)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, place))
        elif kind == "function_call":
            call = _function_call(item, place)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", place)
            if call_id not in calls:
                raise APIError(400, f"{place}.call_id {call_id!r} names no earlier function_call",
                               f"{place}.call_id")  # fmt: skip
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{place}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{place}: items of type {kind!r} are not supported",
                           f"{place}.type")  # fmt: skip
    return messages


def _message(item: dict, place: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"{place}.role must be user, assistant, system or developer",
                       f"{place}.role")  # fmt: skip
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{place}.content")
    return {"role": role, "content": text}


def _text(parts: object, place: str) -> str:
    """The text of a list of content parts."""
    if not isinstance(parts, list):
        raise APIError(400, f"{place} must be a string or a list of parts", place)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{place}[{j}]: parts of type {kind!r} are not supported "
                           "(text only)", f"{place}[{j}].type")  # fmt: skip
        texts.append(_string(part, "refusal" if kind == "refusal" else "text", f"{place}[{j}]"))
    return "".join(texts)


def _function_call(item: dict, place: str) -> dict:
    name = _string(item, "name", place)
    arguments = _string(item, "arguments", place)
    call_id = _string(item, "call_id", place)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _string(item: dict, key: str, place: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{place}.{key} must be a string", f"{place}.{key}")
    return value


# ---------------------------------------------------------------- output


def output_items(chat: ChatCompletionResponse) -> list[dict]:
    """A whole chat answer's choice as output items: its reasoning, its message (when it
    has text), then its calls."""
    message = chat.choices[0].message
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(new_item_id("rs"), message.reasoning_content))
    if message.content:
        items.append(message_item(new_item_id("msg"), message.content))
    for call in message.tool_calls or []:
        items.append(call_item(new_item_id("fc"), call.id, call.function.name,
                               call.function.arguments))  # fmt: skip
    return items


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"):
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip
