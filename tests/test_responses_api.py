"""`/v1/responses`: the translation of input items to chat, the store's bounds, and the
API end to end through the official `openai` client, unmodified (`responses.create`,
`responses.stream`, a function tool round trip, `text.format`, `previous_response_id`,
background runs and their cancellation, reasoning items, and the 4xx of bad input)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from subway.frontend.errors import APIError
from subway.frontend.response_store import ResponseStore, Stored
from subway.frontend.responses_protocol import ResponsesRequest
from subway.frontend.responses_translate import chat_request

from serving import DEFAULT_FLAGS, TINY_FLAGS, until

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}


def translated(history: list[dict] | None = None, **fields):
    req = ResponsesRequest.model_validate({"input": "hi", **fields})
    return chat_request(req, history or [], False)


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        translated(**fields)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------- translation


def test_a_string_input_is_a_user_message_after_the_instructions():
    chat = translated(instructions="be brief", input="hello")
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"),
        ("user", "hello"),
    ]


def test_calls_and_their_outputs_become_tool_calls_and_tool_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    chat = translated(input=items)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in chat.messages[1].tool_calls] == ["c1", "c2"]
    assert [(m.tool_call_id, m.content) for m in chat.messages[2:]] == [
        ("c1", "sunny"),
        ("c2", "rain"),
    ]


def test_an_output_may_answer_a_call_of_the_conversation_continued():
    history = [{"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}]
    out = {"type": "function_call_output", "call_id": "c9", "output": "done"}
    chat = translated(history, input=[out])
    assert [m.role for m in chat.messages] == ["assistant", "tool"]


def test_the_format_tools_and_effort_reach_the_chat_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = translated(
        text={"format": {"type": "json_schema", "name": "x", "schema": schema}},
        tools=[WEATHER],
        tool_choice="auto",
        reasoning={"effort": "low"},
        max_output_tokens=7,
    )
    assert chat.response_format.json_schema.schema_ == schema
    assert chat.tools[0].function.name == "get_weather"
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert chat.max_tokens == 7
    named = translated(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named.tool_choice.function.name == "get_weather"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "function_call_output", "call_id": "x", "output": "o"}]},
         "input[0].call_id"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id"),
        ({"input": [7]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0]"),
    ],
)  # fmt: skip
def test_bad_items_are_400s_naming_their_place(fields, param):
    assert refused(**fields).param == param


# ---------------------------------------------------------------- the store


def stored(rid: str, size: int = 10) -> Stored:
    return Stored(response={"id": rid, "pad": "x" * size}, history=[], input_items=[])


def test_the_store_drops_the_oldest_past_its_count_and_bytes():
    store = ResponseStore(max_items=3, max_bytes=10_000, ttl=0)
    for i in range(5):
        assert store.put(stored(f"r{i}"))
    assert list(store.entries) == ["r2", "r3", "r4"] and store.evicted == 2
    store = ResponseStore(max_items=100, max_bytes=250, ttl=0)
    for i in range(4):
        store.put(stored(f"r{i}", 80))
    assert list(store.entries) == ["r2", "r3"] and store.bytes <= 250
    assert not store.put(stored("huge", 1000)) and store.get("huge") is None


def test_the_store_forgets_after_its_ttl(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("subway.frontend.response_store.time.monotonic", lambda: now[0])
    store = ResponseStore(max_items=10, max_bytes=10_000, ttl=60)
    store.put(stored("old"))
    now[0] += 30
    store.put(stored("new"))
    now[0] += 31
    assert store.get("old") is None and store.get("new") is not None
    assert not ResponseStore(0, 10_000, 0).put(stored("off"))  # --responses-store-max 0


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server(servers, default_model):
    return servers.get(default_model, *DEFAULT_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


ASK = {"model": "m", "input": "What is 2+2?", "max_output_tokens": 64, "temperature": 0}


def test_a_response_is_the_chat_answer(server, client):
    out = client.responses.create(**ASK, instructions="Answer briefly.")
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 64, "temperature": 0, "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": ASK["input"]}]},
        timeout=300,
    ).json()  # fmt: skip
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == chat["usage"]["completion_tokens"]
    finish = chat["choices"][0]["finish_reason"]
    assert out.status == ("incomplete" if finish == "length" else "completed")
    assert out.id.startswith("resp_") and out.output[0].type == "message"


def test_a_streamed_response_is_the_whole_one(client):
    whole = client.responses.create(**ASK)
    with client.responses.stream(**ASK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_tool_round_trip(client):
    forced = client.responses.create(
        model="m", input="What will the weather be in Paris for 3 days?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=80,
    )  # fmt: skip
    (call,) = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model="m", previous_response_id=forced.id, tools=[WEATHER], temperature=0,
        max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.previous_response_id == forced.id
    assert answer.output_text and answer.output[-1].type == "message"
    with client.responses.stream(
        model="m", input="What will the weather be in Paris for 3 days?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=80,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == call.arguments
    assert final.output[0].arguments == call.arguments


def test_a_json_schema_format_gives_valid_json(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        model="m", input="Make up a person.", temperature=0, max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.output_text), schema)


def test_stored_responses_are_got_continued_and_deleted(server, client):
    first = client.responses.create(**ASK, metadata={"k": "v"})
    got = client.responses.retrieve(first.id)
    assert got.output_text == first.output_text and got.metadata == {"k": "v"}
    items = httpx.get(f"{server.url}/v1/responses/{first.id}/input_items").json()
    assert items["data"] == [{"type": "message", "role": "user", "content": ASK["input"]}]
    more = client.responses.create(**{**ASK, "input": "And one more?"},
                                   previous_response_id=first.id)  # fmt: skip
    assert more.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="was not found"):
        client.responses.create(**ASK, previous_response_id=first.id)
    unstored = client.responses.create(**ASK, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_background_response_is_polled_and_cancelled(server, client):
    run = client.responses.create(**ASK, background=True)
    assert run.status == "in_progress"
    until(lambda: client.responses.retrieve(run.id).status != "in_progress", 120)
    assert (
        client.responses.retrieve(run.id).output_text == client.responses.create(**ASK).output_text
    )
    long = client.responses.create(
        **{**ASK, "max_output_tokens": 1500}, background=True, extra_body={"ignore_eos": True}
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="only a background"):
        client.responses.cancel(client.responses.create(**ASK).id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": 5}, "input"),
        ({"input": [{"type": "nope"}]}, "input[0].type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
         "tool_choice"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x " * 5000}, "input"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format"),
        ({"input": "x", "background": True, "store": False}, None),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_in_openai_shape(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].startswith(param)
    assert httpx.get(server.url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.post(server.url + "/v1/responses", json={**ASK, "max_output_tokens": 2},
                      timeout=60).status_code == 200  # fmt: skip


# ---------------------------------------------------------------- reasoning

THINK = re.compile(r"<think>([a-z ]{3,30})</think>([a-z ]{3,30})")
THINKING = {
    "model": "tiny",
    "input": "Think, then answer.",
    "max_output_tokens": 64,
    "temperature": 0,
    "extra_body": {"structured_outputs": {"regex": THINK.pattern}},
}


def test_reasoning_comes_as_its_own_item(servers, tiny_models):
    llama = tiny_models["llama"]
    plain = servers.get(llama, *TINY_FLAGS).url
    qwen3 = servers.get(llama, *TINY_FLAGS, "--reasoning-parser", "qwen3",
                        "--grammar-workers", "1").url  # fmt: skip
    with openai.OpenAI(base_url=plain + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        thought, answer = THINK.fullmatch(c.responses.create(**THINKING).output_text).groups()
    with openai.OpenAI(base_url=qwen3 + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        out = c.responses.create(**THINKING)
        with c.responses.stream(**THINKING) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == thought and out.output_text == answer
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought and final.output_text == answer
    assert final.output[0].content[0].text == thought
