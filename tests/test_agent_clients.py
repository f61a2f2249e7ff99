"""LangChain's OpenAI chat model (`langchain_openai.ChatOpenAI`), unmodified, against a live
server (issue 47): `with_structured_output` by each method (its default, `json_schema`,
`function_calling`; with `include_raw`), `bind_tools` with a forced tool (by name, "any",
`True`) and the round trip of the tool's result, streams that agree with whole answers, the
async calls, and all of it again through `/v1/responses` (`use_responses_api=True`).

Each scenario records what LangChain sent (path and body), so the tests also say which
LangChain path reaches which endpoint, and with what: `with_structured_output`'s default
(`json_schema`) is a `response_format` (`text.format` for `/v1/responses`), `function_calling`
and `bind_tools` are `tools` with a `tool_choice`.

Every scenario runs at once, in one fixture (`results`): one batch on the engine, so the module
stays short; each test then reads its own. Nothing reaches past loopback (`offline`): no
LangSmith tracing, no tiktoken download (nothing here counts tokens)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import operator
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from serving import DEFAULT_FLAGS

ASK = "What is the weather in Paris for the next three days?"
PLAIN = "Name three colors."
APIS = ("chat", "responses")
ENDPOINT = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
MAX_TOKENS = 64


class Weather(BaseModel):
    """The weather forecast of a city"""

    city: Literal["Paris", "London", "Tokyo"] = Field(description="The city")
    days: int = Field(ge=1, le=7, description="How many days ahead")


class Clock(BaseModel):
    """The local time in a time zone"""

    zone: str = Field(max_length=12)


@tool
def get_weather(
    city: Literal["Paris", "London", "Tokyo"], days: Annotated[int, Field(ge=1, le=7)]
) -> str:
    """The weather forecast of a city"""
    return f"sunny in {city} for {days} days, 21 C"


TOOLS = [get_weather, Clock]  # a LangChain tool and a pydantic model, as LangChain takes both

# The client's own noise, not the server's: langchain-openai dumps the `openai` SDK's parsed
# completion, whose `parsed` field is typed None, with the user's model in it
# (langchain-ai/langchain#35538, #37723; openai/openai-python#2872).
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")


# ---------------------------------------------------------------- the client


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No tracing, and every socket this process opens while the module runs goes to
    loopback: one that does not is refused and named at the end."""
    outside: list = []
    real_connect = socket.socket.connect

    def loopback_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                inside = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                inside = False
            if not inside:
                outside.append(address)
                raise OSError(f"test_agent_clients: no network ({address})")
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        for name in ("LANGSMITH_TRACING", "LANGSMITH_TRACING_V2", "LANGCHAIN_TRACING",
                     "LANGCHAIN_TRACING_V2"):  # fmt: skip
            mp.setenv(name, "false")
        mp.setattr(socket.socket, "connect", loopback_only)
        yield
    assert not outside, outside


@pytest.fixture(scope="module")
def server(servers, default_model):
    return servers.get(default_model, *DEFAULT_FLAGS)


class Wire:
    """One scenario's HTTP client, and what went through it: (path, JSON body) per request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent: list[tuple[str, dict]] = []
        self.http = httpx.Client(event_hooks={"request": [self.record]}, timeout=600)

    def record(self, request: httpx.Request) -> None:
        assert str(request.url).startswith(self.url + "/v1/"), request.url
        self.sent.append((request.url.path, json.loads(request.content)))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)

    def model(self, api: str, **kw) -> ChatOpenAI:
        """`ChatOpenAI` as a user of an OpenAI-compatible server writes it, and this wire's
        client. For "chat", no `use_responses_api`: model "m" routes to chat completions."""
        if api == "responses":
            kw["use_responses_api"] = True
        return ChatOpenAI(base_url=self.url + "/v1", api_key="x", model="m", temperature=0,
                          max_retries=0, max_tokens=MAX_TOKENS, stream_usage=True,
                          http_client=self.http, **kw)  # fmt: skip


def joined(chunks: list):
    """A stream's message chunks added up, as LangChain's users assemble them."""
    assert chunks
    return functools.reduce(operator.add, chunks)


# ---------------------------------------------------------------- the scenarios


def structured(wire: Wire, *, api: str, method: str, include_raw: bool):
    kw = {} if method == "default" else {"method": method}
    runnable = wire.model(api).with_structured_output(Weather, include_raw=include_raw, **kw)
    return runnable.invoke(ASK)


def structured_stream(wire: Wire, *, api: str, method: str):
    runnable = wire.model(api).with_structured_output(Weather, method=method)
    return list(runnable.stream(ASK))


def forced(wire: Wire, *, api: str, tool_choice, **kw) -> AIMessage:
    return wire.model(api).bind_tools(TOOLS, tool_choice=tool_choice, **kw).invoke(ASK)


def round_trip(wire: Wire, *, api: str):
    """An agent's loop: a forced call, the tool run on it, and the answer to its result."""
    call = forced(wire, api=api, tool_choice="get_weather")
    result = get_weather.invoke(call.tool_calls[0])  # validates the arguments, or raises
    reply = wire.model(api).bind_tools(TOOLS).invoke([HumanMessage(ASK), call, result])
    return call, result, reply


def plain(wire: Wire, *, api: str):
    model = wire.model(api)
    return model.invoke(PLAIN), list(model.stream(PLAIN))


def tool_stream(wire: Wire, *, api: str):
    model = wire.model(api).bind_tools(TOOLS, tool_choice="get_weather")
    return model.invoke(ASK), list(model.stream(ASK))


def async_calls(wire: Wire, *, api: str):
    async def run():
        hooks = {"request": [wire.arecord]}
        async with httpx.AsyncClient(event_hooks=hooks, timeout=600) as http:
            model = wire.model(api, http_async_client=http)
            parsed = await model.with_structured_output(Weather).ainvoke(ASK)
            return parsed, [c async for c in model.astream(PLAIN)]

    return asyncio.run(run())


CHOICES = {
    "name": dict(tool_choice="get_weather"),
    "model-name": dict(tool_choice="Clock"),
    "any": dict(tool_choice="any"),
    "true-single": dict(tool_choice=True, parallel_tool_calls=False),
}
METHODS = ("default", "json_schema", "function_calling")


def scenarios() -> dict[tuple, functools.partial]:
    """key -> the scenario, to call with its wire."""
    out: dict[tuple, functools.partial] = {}
    for api in APIS:
        for method in METHODS:
            for raw in (False, True):
                out["structured", api, method, raw] = functools.partial(
                    structured, api=api, method=method, include_raw=raw
                )
        for method in ("json_schema", "function_calling"):
            out["structured-stream", api, method] = functools.partial(
                structured_stream, api=api, method=method
            )
        for name, kw in CHOICES.items():
            out["forced", api, name] = functools.partial(forced, api=api, **kw)
        for name, scenario in (("round-trip", round_trip), ("plain", plain),
                               ("tool-stream", tool_stream), ("async", async_calls)):  # fmt: skip
            out[name, api] = functools.partial(scenario, api=api)
    return out


@pytest.fixture(scope="module")
def results(server):
    """key -> (the scenario's outcome, its wire); a test's `.result()` raises what it raised."""
    asked = scenarios()
    wires = {key: Wire(server.url) for key in asked}
    with ThreadPoolExecutor(len(asked)) as pool:
        out = {
            key: (pool.submit(scenario, wires[key]), wires[key]) for key, scenario in asked.items()
        }
    yield out
    for wire in wires.values():
        wire.http.close()


def outcome(results, *key):
    future, wire = results[key]
    return future.result(), wire


def paths(wire: Wire) -> set[str]:
    return {path for path, _ in wire.sent}


def tool_choice_sent(body: dict):
    """The tool_choice of a request: a forced function's name, or the string sent."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        assert choice["type"] == "function", choice
        return (choice["function"] if "function" in choice else choice)["name"]
    return choice


def format_sent(api: str, body: dict) -> dict | None:
    return body.get("response_format") if api == "chat" else body.get("text", {}).get("format")


def check_call(call: dict) -> None:
    """A tool call whose arguments validate against its tool's schema."""
    assert call["id"] and call["type"] == "tool_call", call
    if call["name"] == "get_weather":
        result = get_weather.invoke(call)  # runs the tool: the arguments validate, or it raises
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    else:
        assert call["name"] == "Clock", call
        Clock.model_validate(call["args"])


# ---------------------------------------------------------------- structured output


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("api", APIS)
def test_structured_output_is_an_instance_of_the_model(results, api, method):
    parsed, wire = outcome(results, "structured", api, method, False)
    assert isinstance(parsed, Weather), parsed
    assert parsed.city in ("Paris", "London", "Tokyo") and 1 <= parsed.days <= 7
    ((path, body),) = wire.sent
    assert path == ENDPOINT[api]
    if method == "function_calling":
        assert tool_choice_sent(body) == "Weather" and format_sent(api, body) is None
    else:  # langchain-openai >= 0.3's default is json_schema: a response format, no tools
        fmt = format_sent(api, body)
        assert fmt["type"] == "json_schema" and "tools" not in body, body
        schema = fmt["json_schema"]["schema"] if api == "chat" else fmt["schema"]
        assert schema["properties"]["days"]["maximum"] == 7


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("api", APIS)
def test_structured_output_with_the_raw_message(results, api, method):
    out, wire = outcome(results, "structured", api, method, True)
    assert out["parsing_error"] is None
    parsed, raw = out["parsed"], out["raw"]
    assert isinstance(parsed, Weather) and isinstance(raw, AIMessage)
    if method == "function_calling":
        (call,) = raw.tool_calls
        assert call["name"] == "Weather" and Weather.model_validate(call["args"]) == parsed
    else:
        assert not raw.tool_calls and Weather.model_validate_json(raw.text) == parsed
    # The same request as without the raw message, and the same greedy answer.
    plain_parsed, plain_wire = outcome(results, "structured", api, method, False)
    assert parsed == plain_parsed and wire.sent == plain_wire.sent


@pytest.mark.parametrize("method", ("json_schema", "function_calling"))
@pytest.mark.parametrize("api", APIS)
def test_structured_output_streams_to_the_same_object(results, api, method):
    parts, wire = outcome(results, "structured-stream", api, method)
    whole, _ = outcome(results, "structured", api, method, False)
    assert parts and all(isinstance(p, Weather) for p in parts), parts
    assert parts[-1] == whole
    ((path, body),) = wire.sent
    assert path == ENDPOINT[api] and body["stream"] is True


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("api", APIS)
def test_a_forced_tool_is_called_with_valid_arguments(results, api, choice):
    message, wire = outcome(results, "forced", api, choice)
    assert message.tool_calls and not message.invalid_tool_calls, message
    for call in message.tool_calls:
        check_call(call)
    ((path, body),) = wire.sent
    assert path == ENDPOINT[api]
    assert [t.get("name") or t["function"]["name"] for t in body["tools"]] == [
        "get_weather",
        "Clock",
    ]
    asked = CHOICES[choice]["tool_choice"]
    if asked in ("get_weather", "Clock"):
        assert tool_choice_sent(body) == asked
        assert [c["name"] for c in message.tool_calls] == [asked]
    else:  # "any" and True are OpenAI's "required"
        assert tool_choice_sent(body) == "required"
    if "parallel_tool_calls" in CHOICES[choice]:
        assert body["parallel_tool_calls"] is False and len(message.tool_calls) == 1
    if api == "chat":  # (greedy, the small model may start another call until max_tokens)
        assert message.response_metadata["finish_reason"] in ("tool_calls", "length")


@pytest.mark.parametrize("api", APIS)
def test_a_tool_result_is_answered_in_text(results, api):
    (call, result, reply), wire = outcome(results, "round-trip", api)
    call_id = call.tool_calls[0]["id"]
    assert result.tool_call_id == call_id and result.content.startswith("sunny in ")
    assert isinstance(reply, AIMessage) and reply.text.strip(), reply
    assert not reply.tool_calls and not reply.invalid_tool_calls, reply
    assert [path for path, _ in wire.sent] == [ENDPOINT[api]] * 2
    (_, first), (_, second) = wire.sent
    assert tool_choice_sent(first) == "get_weather" and "tool_choice" not in second
    if api == "chat":
        user, assistant, answer = second["messages"]
        assert assistant["role"] == "assistant"
        assert [c["id"] for c in assistant["tool_calls"]] == [call_id]
        assert answer == {"role": "tool", "tool_call_id": call_id, "content": result.content}
    else:  # the function_call item goes back as it came (its id and status too)
        kinds = [item["type"] for item in second["input"]]
        assert kinds == ["message", "function_call", "function_call_output"], second["input"]
        assert second["input"][1]["call_id"] == call_id
        assert second["input"][2]["output"] == result.content


# ---------------------------------------------------------------- streams


@pytest.mark.parametrize("api", APIS)
def test_a_stream_joins_to_the_whole_answer(results, api):
    (whole, chunks), wire = outcome(results, "plain", api)
    assert whole.text.strip() and len(chunks) > 2
    streamed = joined(chunks)
    assert "".join(c.text for c in chunks) == streamed.text == whole.text
    assert streamed.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"] > 0
    assert streamed.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"] > 0
    (_, one), (_, other) = wire.sent
    assert paths(wire) == {ENDPOINT[api]} and not one.get("stream") and other["stream"] is True
    if api == "chat":  # stream_usage=True asks for the usage chunk
        assert other["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("api", APIS)
def test_streamed_tool_call_chunks_assemble_into_the_whole_call(results, api):
    (whole, chunks), wire = outcome(results, "tool-stream", api)
    streamed = joined(chunks)
    assert not streamed.invalid_tool_calls, streamed.invalid_tool_calls
    (piece,) = streamed.tool_call_chunks  # every piece of the call joined by its index
    assert piece["name"] == "get_weather" and json.loads(piece["args"])
    (call,) = streamed.tool_calls
    check_call(call)
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]
    if api == "chat":
        assert streamed.response_metadata["finish_reason"] == "tool_calls"
    assert paths(wire) == {ENDPOINT[api]}


@pytest.mark.parametrize("api", APIS)
def test_async_calls_match_the_sync_ones(results, api):
    (parsed, chunks), wire = outcome(results, "async", api)
    sync_parsed, _ = outcome(results, "structured", api, "default", False)
    (sync_whole, _), _ = outcome(results, "plain", api)
    assert isinstance(parsed, Weather) and parsed == sync_parsed
    assert joined(chunks).text == sync_whole.text
    assert [path for path, _ in wire.sent] == [ENDPOINT[api]] * 2
