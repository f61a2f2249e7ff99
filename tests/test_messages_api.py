"""Anthropic's Messages API (`POST /v1/messages`, frontend/messages_api.py).

Without a server: a Messages request's blocks, tools and tool_choice become the
chat request that runs it, and what cannot be translated is a 400; a chat answer
becomes a Messages answer, whole or as Anthropic's events, the two agreeing
(reasoning apart, calls parsed, a stop sequence cut off however the output is cut
into pieces), and a failure after a stream started is its last event.

End to end, through the official `anthropic` client: `messages.create` and
`messages.stream` agree with each other and with `/v1/chat/completions` on the
same greedy request (text, usage, stop sequence); a forced tool call round-trips
on the default model, streamed too; `--reasoning-parser qwen3` gives a thinking
block apart from the text; bad requests are 4xx in Anthropic's shape; the API key
is taken from `x-api-key`, and a wrong one is a 401 in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from subway.frontend.chat import ChatView
from subway.frontend.choices import ChoiceEvent, GenerationError
from subway.frontend.errors import APIError
from subway.frontend.inputs import Job, Prompt
from subway.frontend.messages_api import EventStream, answer_events, read_request, to_message
from subway.frontend.messages_protocol import MessagesRequest, error_body
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
)
from subway.ipc.config import ServerConfig
from subway.ipc.messages import SamplingParams

from serving import DEFAULT_FLAGS, TINY_FLAGS, Server

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA,
     "cache_control": {"type": "ephemeral"}},
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


def translate(**fields) -> tuple[MessagesRequest, ChatCompletionRequest]:
    body = {"model": "m", "max_tokens": 8, "messages": ASK, **fields}
    return read_request(json.dumps(body).encode())


def chat_messages(**fields) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in translate(**fields)[1].messages]


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        translate(**fields)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------- the request


def test_blocks_become_chat_messages_in_order():
    messages = chat_messages(
        system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Really."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "days": 3}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "text", "text": "Here:"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                 "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}]},
                {"type": "text", "text": "Thanks."},
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3",
                                               "name": "get_time", "input": {"zone": "CET"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        ],
        tools=TOOLS,
        metadata={"user_id": "u-1"},
    )  # fmt: skip

    def call(i: str, name: str, args: str) -> dict:
        return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}

    assert messages == [
        {"role": "system", "content": "Be terse.\nReally."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            call("toolu_1", "get_weather", '{"city": "Paris", "days": 3}'),
            call("toolu_2", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_time", "content": "12:00"},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "sunny\n21 C"},
        {"role": "user", "content": "Here:\nThanks."},
        {"role": "assistant", "tool_calls": [call("toolu_3", "get_time", '{"zone": "CET"}')]},
        {"role": "tool", "tool_call_id": "toolu_3", "name": "get_time", "content": ""},
    ]  # fmt: skip


def test_tools_and_sampling_fields_reach_the_chat_request():
    req, chat = translate(
        system="Be terse.",
        tools=TOOLS,
        temperature=1.5,  # past Anthropic's 1: this server's range
        top_p=0.9,
        top_k=5,
        seed=7,
        stop_sequences=["END", ""],
        thinking={"type": "enabled", "budget_tokens": 2048},
        chat_template_kwargs={"custom": 1, "enable_thinking": False},
        structured_outputs={"regex": "[a-z]+"},
        stream=True,
        service_tier="auto",  # unknown fields are ignored, as the chat endpoint's
    )
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be terse."
    fn = chat.tools[0].function
    assert (fn.name, fn.description, fn.parameters) == ("get_weather", "The weather in a city",
                                                        WEATHER_SCHEMA)  # fmt: skip
    assert chat.tools[1].function.parameters == TIME_SCHEMA
    assert (chat.temperature, chat.top_p, chat.top_k, chat.seed) == (1.5, 0.9, 5, 7)
    assert chat.max_tokens == 8 and chat.model == "m"
    assert chat.stop == ["END"] and chat.include_stop_str_in_output
    assert chat.chat_template_kwargs == {"custom": 1, "enable_thinking": True}
    assert chat.structured_outputs.regex == "[a-z]+"
    assert chat.stream and chat.include_usage
    assert chat.tool_choice is None and chat.parallel_tool_calls
    _, chat = translate(thinking={"type": "disabled"})
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert not chat.stream and not chat.include_stop_str_in_output and chat.stop is None


def test_anthropics_structured_outputs_and_thinking_types_are_taken():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    _, chat = translate(output_config=fmt)
    assert chat.structured_outputs.json_ == schema
    assert "not both" in refused(output_config=fmt, structured_outputs={"regex": "a"}).message
    _, chat = translate(output_config={"effort": "high"})
    assert chat.structured_outputs is None
    for kind, enabled in (("adaptive", True), ("between_tools", True), ("disabled", False)):
        _, chat = translate(thinking={"type": kind})
        assert chat.chat_template_kwargs == {"enable_thinking": enabled}


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}, True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "auto", "disable_parallel_tool_use": False}, "auto", True),
    ],
)  # fmt: skip
def test_tool_choice_maps_to_chat(choice, expected, parallel):
    _, chat = translate(tools=TOOLS, tool_choice=choice)
    got = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    assert got == expected and chat.parallel_tool_calls is parallel


def test_a_last_assistant_message_is_continued():
    prefill = [*ASK, {"role": "assistant", "content": "The weather is"}]
    _, chat = translate(messages=prefill)
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1].content == "The weather is"
    thinking_only = [
        *ASK,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]},
    ]
    _, chat = translate(messages=thinking_only)  # nothing to continue: dropped
    assert not chat.continue_final_message and chat.add_generation_prompt
    assert [m.role for m in chat.messages] == ["user"]


def _tool_use(i: str = "toolu_1") -> dict:
    return {"type": "tool_use", "id": i, "name": "get_time", "input": {}}


def _user(*blocks: dict) -> dict:
    return {"role": "user", "content": list(blocks)}


BAD = {
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "8"}, "max_tokens"),
    "stream a string": ({"stream": "yes"}, "stream"),
    "temperature below 0": ({"temperature": -0.5}, "temperature"),
    "no messages": ({"messages": []}, "messages"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    "role system": ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    "text not a string": ({"messages": [_user({"type": "text", "text": 5})]}, "text"),
    "image": ({"messages": [_user({"type": "image", "source": {"type": "url", "url": "x"}})]},
              "image blocks are not supported"),
    "document in a result": (
        {"messages": [{"role": "assistant", "content": [_tool_use()]},
                      _user({"type": "tool_result", "tool_use_id": "toolu_1",
                             "content": [{"type": "document", "source": {}}]})]},
        "document blocks are not supported"),
    "unknown block type": ({"messages": [_user({"type": "hologram"})]}, "unknown block type"),
    "system image": ({"system": [{"type": "image", "source": {}}]}, "system"),
    "unknown tool_use_id": (
        {"messages": [{"role": "assistant", "content": [_tool_use("toolu_1")]},
                      _user({"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"})]},
        "toolu_9"),
    "result before its call": (
        {"messages": [_user({"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}),
                      {"role": "assistant", "content": [_tool_use("toolu_1")]}, *ASK]},
        "tool_use_id"),
    "tool_use from the user": ({"messages": [_user(_tool_use())]}, "assistant messages"),
    "tool_result from the assistant": (
        {"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
        "user messages"),
    "a call left unanswered": ({"messages": [*ASK, {"role": "assistant", "content": [_tool_use()]}]},
                               "tool_result"),
    "tool_use input not an object": (
        {"messages": [{"role": "assistant", "content": [{**_tool_use(), "input": "x"}]}, *ASK]},
        "input"),
    "tool_choice names no tool": ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
                                  "tool_choice"),
    "tool_choice tool without a name": ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "name"),
    "tool_choice of an unknown type": ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    "a tool without a schema": ({"tools": [{"name": "f"}]}, "input_schema"),
    "a tool name with a space": ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools.0.name"),
    "too many stop sequences": ({"stop_sequences": ["x"] * 17}, "stop sequences"),
    "thinking of an unknown type": ({"thinking": {"type": "sometimes"}}, "thinking"),
    "a bad structured output": ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_cannot_be_translated_is_a_400(case):
    fields, named = BAD[case]
    body = {"model": "m", "max_tokens": 8, "messages": ASK, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(APIError) as e:
        read_request(json.dumps(body).encode())
    assert e.value.status == 400
    assert named in e.value.message or named in (e.value.param or ""), e.value.message
    assert error_body(e.value) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.message},
    }


def test_error_types_follow_the_status():
    kinds = {s: error_body(APIError(s, "x"))["error"]["type"] for s in
             (400, 401, 403, 404, 405, 413, 429, 500, 503, 529, 502)}  # fmt: skip
    assert kinds == {400: "invalid_request_error", 401: "authentication_error",
                     403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                     503: "overloaded_error", 529: "overloaded_error", 502: "api_error"}  # fmt: skip


# ---------------------------------------------------------------- the answer


def chat_answer(content, reasoning=None, calls=(), finish="stop") -> ChatCompletionResponse:
    tool_calls = [ResponseToolCall(id=f"call_{k}", function=ResponseFunctionCall(name=n, arguments=a))
                  for k, (n, a) in enumerate(calls)]  # fmt: skip
    extra = {} if reasoning is None else {"reasoning_content": reasoning}
    message = AssistantMessage(content=content, tool_calls=tool_calls, **extra)
    choice = ChatChoice(index=0, message=message, finish_reason=finish)
    usage = Usage(prompt_tokens=7, completion_tokens=5, total_tokens=12)
    return ChatCompletionResponse(id="x", model="tiny", choices=[choice], usage=usage)


def blocks_of(message: dict) -> list[dict]:
    """The content blocks, without the tool ids (made anew for each answer)."""
    out = []
    for b in message["content"]:
        if b["type"] == "tool_use":
            assert re.fullmatch(r"toolu_[0-9a-f]{24}", b["id"]), b
            b = {k: v for k, v in b.items() if k != "id"}
        out.append(b)
    return out


def test_a_chat_answer_becomes_blocks():
    req, _ = translate()
    calls = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "not json"),
             ("get_time", "[1, 2]"), ("get_time", "  "), ("get_time", "[" * 100 + "]" * 100)]  # fmt: skip
    message = to_message(chat_answer("Sure.", "I think.", calls, "tool_calls"), req, "msg_1")
    out = message.model_dump()
    assert blocks_of(out) == [
        {"type": "thinking", "thinking": "I think.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
        {"type": "text", "text": "not json"},  # not an object: as text, never a 500
        {"type": "text", "text": "[1, 2]"},
        {"type": "tool_use", "name": "get_time", "input": {}},
        {"type": "text", "text": "[" * 100 + "]" * 100},
    ]
    assert (out["id"], out["type"], out["role"], out["model"]) == ("msg_1", "message", "assistant",
                                                                   "tiny")  # fmt: skip
    assert out["stop_reason"] == "tool_use" and out["stop_sequence"] is None
    assert out["usage"] == {"input_tokens": 7, "output_tokens": 5}
    for finish, reason in (("stop", "end_turn"), ("length", "max_tokens"), ("abort", "end_turn")):
        out = to_message(chat_answer("", finish=finish), req, "m").model_dump()
        assert out["stop_reason"] == reason and out["content"] == []  # empty text: no block


def test_the_stop_sequence_that_ended_the_text_is_named_and_cut():
    req, _ = translate(stop_sequences=["D", "END", "zz"])
    out = to_message(chat_answer("Hello END"), req, "m").model_dump()
    assert out["content"] == [{"type": "text", "text": "Hello "}]  # the longest that ends it
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")
    out = to_message(chat_answer("Hello"), req, "m").model_dump()  # an EOS: the text is whole
    assert out["content"][0]["text"] == "Hello" and out["stop_reason"] == "end_turn"
    out = to_message(chat_answer("Hello END", finish="length"), req, "m").model_dump()
    assert out["content"][0]["text"] == "Hello END" and out["stop_sequence"] is None
    out = to_message(chat_answer(None, "still thinkzz"), req, "m").model_dump()
    assert out["content"] == [{"type": "thinking", "thinking": "still think", "signature": ""}]
    assert out["stop_sequence"] == "zz"


# ---- whole and streamed, through the chat view


class FakeGroup:
    """What `ChatView` reads of a `ChoiceGroup`: one choice's pieces of text."""

    max_bytes = 0

    def __init__(self, pieces: list[str], fail_after: int | None = None) -> None:
        self.pieces, self.fail_after = pieces, fail_after

    async def events(self):
        for k, text in enumerate(self.pieces):
            if k == self.fail_after:
                raise GenerationError("the engine failed")
            last = k == len(self.pieces) - 1
            yield ChoiceEvent(0, text, [k], finish_reason="stop" if last else None)

    def close(self) -> None:
        pass


class FakeRun:
    def __init__(self, view: ChatView, group: FakeGroup) -> None:
        self.view, self.group, self.closed = view, group, False

    def close(self) -> None:
        self.closed = True


def parse_sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for part in text.split("\n\n"):
        if part:
            kind, data = part.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: "), part
            events.append((kind[len("event: ") :], json.loads(data[len("data: ") :])))
    return events


def assemble(events: list[tuple[str, dict]]) -> dict:
    """The message a client builds from the events, checking their order on the way."""
    events = copy.deepcopy(events)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    message = events[0][1]["message"]
    assert message["content"] == [] and message["usage"]["output_tokens"] == 0
    json_parts: list[str] = []
    open_index = None
    for kind, data in events[2:-2]:
        assert data["type"] == kind
        if kind == "content_block_start":
            assert open_index is None and data["index"] == len(message["content"])
            open_index = data["index"]
            message["content"].append(data["content_block"])
            json_parts = []
        elif kind == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][open_index], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if field is None:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                json_parts.append(delta["partial_json"])
            else:
                assert block["type"] == field and delta[field]
                block[field] += delta[field]
        else:
            assert kind == "content_block_stop" and data["index"] == open_index
            if message["content"][open_index]["type"] == "tool_use" and json_parts:
                message["content"][open_index]["input"] = json.loads("".join(json_parts))
            open_index = None
    assert open_index is None
    message.update(events[-2][1]["delta"])
    message["usage"].update(events[-2][1]["usage"])
    return message


def both(pieces: list[str], parser: str = "", **fields) -> tuple[dict, dict, list]:
    """The whole answer, the streamed one as a client assembles it, and the raw events."""
    config = ServerConfig(reasoning_parser=parser)
    job = Job([Prompt([1, 2, 3])], [SamplingParams()])

    async def run():
        req, chat = translate(**fields)
        view = ChatView(chat, job, "msg_1", "tiny", None, config)
        whole = to_message(await view.whole(FakeGroup(pieces)), req, "msg_1").model_dump()
        req, chat = translate(stream=True, **fields)
        fake = FakeRun(ChatView(chat, job, "msg_1", "tiny", None, config), FakeGroup(pieces))
        stream = EventStream("msg_1", "tiny", 3, req.stops())
        text = "".join([e async for e in answer_events(fake, stream)])
        assert fake.closed
        return whole, parse_sse(text)

    whole, events = asyncio.run(run())
    streamed = assemble(events)
    for message in (whole, streamed):
        message["content"] = blocks_of(message)
    assert streamed["usage"] == whole["usage"] == {"input_tokens": 3, "output_tokens": len(pieces)}
    return whole, streamed, events


def test_streamed_and_whole_agree_on_reasoning_and_text():
    whole, streamed, events = both(["<thi", "nk>a b", "</think", ">c ", "d"], parser="qwen3")
    assert whole["content"] == [
        {"type": "thinking", "thinking": "a b", "signature": ""},
        {"type": "text", "text": "c d"},
    ]
    assert streamed == whole and whole["stop_reason"] == "end_turn"
    deltas = [d["delta"]["type"] for k, d in events if k == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"


def test_streamed_and_whole_agree_on_calls():
    call = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    )
    whole, streamed, _ = both(["Sure.\n", call[:20], call[20:]], tools=TOOLS)
    assert whole["content"] == [
        {"type": "text", "text": "Sure.\n"},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
    ]
    assert streamed == whole and whole["stop_reason"] == "tool_use"
    forced = {"type": "tool", "name": "get_weather"}
    # A forced call is written in the model's format (hermes here) and read by its parser.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    whole, streamed, events = both([call[:15], call[15:40], call[40:]], tools=TOOLS,
                                   tool_choice=forced)  # fmt: skip
    assert whole["content"] == [
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 2}}
    ]
    assert streamed == whole and whole["stop_reason"] == "tool_use"
    start = next(d for k, d in events if k == "content_block_start")
    assert start["content_block"]["input"] == {}
    pieces = [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"]
    assert [json.loads(p) for p in pieces] == [{"city": "Paris", "days": 2}]  # as its block closes


@pytest.mark.parametrize("stops", [["END"], ["D", "END", "never"]])
def test_a_stop_sequence_is_cut_however_the_text_is_cut(stops):
    text = "Hello, world END"
    cuts = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for pieces in cuts:
        whole, streamed, _ = both(pieces, stop_sequences=stops)
        assert whole["content"] == [{"type": "text", "text": "Hello, world "}], pieces
        assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")
        assert streamed == whole, pieces
    whole, streamed, _ = both(["Hello", " there"], stop_sequences=stops)  # ended otherwise
    assert whole["content"] == [{"type": "text", "text": "Hello there"}]
    assert whole["stop_reason"] == "end_turn" and whole["stop_sequence"] is None
    assert streamed == whole


def test_a_failure_after_the_stream_started_is_its_last_event():
    async def run():
        req, chat = translate(stream=True)
        job = Job([Prompt([1, 2, 3])], [SamplingParams()])
        fake = FakeRun(ChatView(chat, job, "msg_1", "tiny", None, ServerConfig()),
                       FakeGroup(["Hello", " there", "!"], fail_after=2))  # fmt: skip
        stream = EventStream("msg_1", "tiny", 3, req.stops())
        text = "".join([e async for e in answer_events(fake, stream)])
        assert fake.closed
        return parse_sse(text)

    events = asyncio.run(run())
    assert [k for k, _ in events][:3] == ["message_start", "ping", "content_block_start"]
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "the engine failed"}})  # fmt: skip
    assert "message_stop" not in [k for k, _ in events]


# ---------------------------------------------------------------- end to end

KEY = "subway-messages-test-key"
STORY = {
    "model": "tiny",
    "max_tokens": 24,
    "messages": [{"role": "user", "content": "Tell me about the trains of the city."}],
}
# The `anthropic` client (2.x) has no sampling arguments any more: they go in the body.
GREEDY = {"temperature": 0.0}
THINK = re.compile(r"<think>([a-z ]{3,30})</think>([a-z ]{3,30})")
THINKING = {
    "model": "tiny",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Think, then answer."}],
}
FORCE_THINK = {"structured_outputs": {"regex": THINK.pattern}, **GREEDY}


@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    """The tiny Llama behind an API key (from a file: a key on the command line shows in
    ps), the shared servers' flags otherwise."""
    path = tmp_path_factory.mktemp("messages") / "api.key"
    path.write_text(KEY)
    path.chmod(0o600)
    server = Server(tiny_models["llama"], *TINY_FLAGS, "--api-key-file", str(path))
    yield server
    server.stop()


def client(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def chat(url: str, body: dict) -> dict:
    """A chat completion's only choice and its usage."""
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0] | {"usage": out["usage"]}


def text_of(message) -> str:
    assert all(b.type == "text" for b in message.content), message.content
    return "".join(b.text for b in message.content)


def same_usage(message, expected: dict) -> bool:
    usage = message.usage
    return (usage.input_tokens, usage.output_tokens) == (
        expected["prompt_tokens"],
        expected["completion_tokens"],
    )


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    headers = {"x-api-key": KEY}
    body = {**body, "stream": True}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.read().decode())


def test_create_stream_and_chat_completions_agree(keyed):
    expected = chat(keyed.url, {**STORY, **GREEDY})
    text = expected["message"]["content"]
    assert text
    reason = {"length": "max_tokens", "stop": "end_turn"}[expected["finish_reason"]]
    with client(keyed.url, KEY) as c:
        made = c.messages.create(**STORY, extra_body=GREEDY)
        with c.messages.stream(**STORY, extra_body=GREEDY) as stream:
            final = stream.get_final_message()
    for message in (made, final):
        assert text_of(message) == text and same_usage(message, expected["usage"])
        assert message.stop_reason == reason and message.stop_sequence is None
        assert (message.type, message.role, message.model) == ("message", "assistant", "tiny")
        assert re.fullmatch(r"msg_[0-9a-f]{32}", message.id)
    events = raw_events(keyed.url, {**STORY, **GREEDY})
    assembled = assemble(events)
    assert assembled["content"] == [{"type": "text", "text": text}]
    assert events[0][1]["message"]["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert assembled["usage"]["output_tokens"] == expected["usage"]["completion_tokens"]


def test_count_tokens_is_the_prompt_the_message_would_take(keyed):
    expected = chat(keyed.url, {**STORY, **GREEDY})["usage"]["prompt_tokens"]
    with client(keyed.url, KEY) as c:
        fields = {k: v for k, v in STORY.items() if k != "max_tokens"}
        counted = c.messages.count_tokens(**fields)
        assert counted.input_tokens == expected
        with pytest.raises(anthropic.BadRequestError):
            c.messages.count_tokens(model=STORY["model"], messages=[{"role": "user"}])
        with pytest.raises(anthropic.NotFoundError):
            c.messages.count_tokens(model="nope", messages=STORY["messages"])


def test_the_stop_sequence_that_ended_the_answer_is_named(keyed):
    full = chat(keyed.url, {**STORY, **GREEDY})["message"]["content"]
    at = next(i for i in range(len(full) // 2, len(full) - 1) if full[i : i + 2].strip())
    stop = full[at : at + 2]  # from the middle on: the first two characters not all blank
    expected = chat(keyed.url, {**STORY, **GREEDY, "stop": [stop]})
    assert expected["finish_reason"] == "stop"
    stops = [stop, "\u2603never"]
    with client(keyed.url, KEY) as c:
        made = c.messages.create(**STORY, stop_sequences=stops, extra_body=GREEDY)
        with c.messages.stream(**STORY, stop_sequences=stops, extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        unmatched = c.messages.create(**STORY, stop_sequences=["\u2603never"], extra_body=GREEDY)
    for message in (made, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert text_of(message) == expected["message"]["content"]
        assert same_usage(message, expected["usage"])
    assert text_of(unmatched) == full and unmatched.stop_sequence is None


@pytest.fixture(scope="module")
def qwen3_url(servers, tiny_models) -> str:
    flags = ("--reasoning-parser", "qwen3", "--grammar-workers", "1")  # test_reasoning.py's
    return servers.get(tiny_models["llama"], *TINY_FLAGS, *flags).url


def test_a_think_block_is_a_thinking_block(keyed, qwen3_url):
    plain = chat(keyed.url, {**THINKING, **FORCE_THINK})
    thought, answer = THINK.fullmatch(plain["message"]["content"]).groups()
    with client(keyed.url, KEY) as c:  # without a parser; an EOS ends it, not the stop
        whole = c.messages.create(**THINKING, stop_sequences=["QQ"], extra_body=FORCE_THINK)
    assert text_of(whole) == plain["message"]["content"] and whole.stop_reason == "end_turn"
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with client(qwen3_url) as c:
        made = c.messages.create(**THINKING, thinking=thinking, extra_body=FORCE_THINK)
        with c.messages.stream(**THINKING, thinking=thinking, extra_body=FORCE_THINK) as stream:
            deltas = [e.delta for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    for message in (made, final):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == thought and message.content[1].text == answer
        assert message.stop_reason == "end_turn" and same_usage(message, plain["usage"])
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_bad_requests_are_4xx_in_anthropics_shape(keyed):
    url, headers = keyed.url + "/v1/messages", {"x-api-key": KEY}

    def post(body, status: int, kind: str = "invalid_request_error", **kw) -> str:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url, content=data, headers=headers | kw, timeout=120)
        return anthropic_error(r, status, kind)

    assert "max_tokens" in post({k: v for k, v in STORY.items() if k != "max_tokens"}, 400)
    assert "max_tokens" in post({**STORY, "max_tokens": "24"}, 400)
    assert "messages.0.content" in post(
        {**STORY, "messages": [{"role": "user", "content": 5}]}, 400
    )
    assert "malformed JSON" in post(b'{"model": ', 400)
    assert "max_tokens" in post({**STORY, "max_tokens": 100_000}, 400)  # past the context
    assert "context" in post(
        {**STORY, "messages": [{"role": "user", "content": "word " * 3000}]}, 400
    )
    assert "tool_choice" in post({**STORY, "tool_choice": {"type": "any"}}, 400)  # no tools
    assert "does not exist" in post({**STORY, "model": "claude-nope"}, 404, "not_found_error")
    big = b"x" * (8 * 1024 * 1024 + 1)  # the middleware's limit, by Content-Length
    assert "larger" in post(big, 413, "request_too_large")
    r = httpx.get(url, headers=headers, timeout=30)
    assert "POST" in anthropic_error(r, 405, "invalid_request_error")
    bad_blocks = {
        "unknown block type": [{"type": "hologram"}],
        "not supported": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}],
        "toolu_404": [{"type": "tool_result", "tool_use_id": "toolu_404", "content": "x"}],
    }
    with client(keyed.url, KEY) as c:
        for says, content in bad_blocks.items():
            with pytest.raises(anthropic.BadRequestError) as e:
                c.messages.create(**{**STORY, "messages": [{"role": "user", "content": content}]})
            assert e.value.status_code == 400 and says in e.value.body["error"]["message"]
            assert e.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(**STORY, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
        assert "nope" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            c.messages.create(**{**STORY, "model": "claude-nope"})
        assert text_of(c.messages.create(**STORY))  # and it still answers


def test_the_api_key_is_taken_from_x_api_key(keyed):
    url = keyed.url
    with client(url, "wrong-key") as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(**STORY)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid or missing API key"}}  # fmt: skip
    r = httpx.post(url + "/v1/messages", json=STORY, timeout=30)  # no key at all
    anthropic_error(r, 401, "authentication_error")
    r = httpx.post(url + "/v1/messages/count_tokens", json=STORY, timeout=30)
    anthropic_error(r, 401, "authentication_error")  # the Messages API's paths, all of them
    r = httpx.post(
        url + "/v1/chat/completions", json=STORY, headers={"x-api-key": "no"}, timeout=30
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # OpenAI's
    bearer = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/messages", json=STORY, headers=bearer, timeout=120)
    assert r.status_code == 200 and r.json()["content"], r.text
    r = httpx.post(
        url + "/v1/chat/completions", json=STORY, headers={"x-api-key": KEY}, timeout=120
    )
    assert r.status_code == 200, r.text
    with client(url, KEY) as c:
        assert text_of(c.messages.create(**STORY))
    assert keyed.proc.poll() is None


# ---- tools, on the default model


@pytest.fixture(scope="module")
def default_url(servers, default_model) -> str:
    return servers.get(default_model, *DEFAULT_FLAGS).url


def test_a_forced_tool_call_round_trips(default_url):
    ask = {"model": "m", "max_tokens": 48, "messages": ASK, "tools": TOOLS, "extra_body": GREEDY}
    forced = {"type": "tool", "name": "get_weather"}
    with client(default_url) as c:
        made = c.messages.create(**ask, tool_choice=forced)
        with c.messages.stream(**ask, tool_choice=forced) as stream:
            pieces = [e.delta.partial_json for e in stream
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]  # fmt: skip
            final = stream.get_final_message()
    for message in (made, final):
        assert message.stop_reason == "tool_use"
        (call,) = message.content
        assert call.type == "tool_use" and call.name == "get_weather"
        assert re.fullmatch(r"toolu_[0-9a-f]{24}", call.id)
        jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert pieces and json.loads("".join(pieces)) == final.content[0].input
    assert final.content[0].input == made.content[0].input
    call = made.content[0]
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in made.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]},
    ]  # fmt: skip
    reply = {**ask, "max_tokens": 16, "messages": history, "tool_choice": {"type": "none"}}
    with client(default_url) as c:
        answer = c.messages.create(**reply)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    arguments = json.dumps(call.input)
    expected = chat(default_url, {
        "model": "m", "max_tokens": 16, "temperature": 0.0, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                   "description": t.get("description")}}
                  for t in TOOLS],
        "messages": [*ASK,
                     {"role": "assistant", "content": None, "tool_calls": [{"id": call.id,
                      "type": "function", "function": {"name": call.name, "arguments": arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
    })  # fmt: skip
    assert text_of(answer) == expected["message"]["content"] and text_of(answer)
    assert same_usage(answer, expected["usage"])
