"""Tool (function) calling: the prompt, the constraints, the output parser, and the API end to
end through the `openai` client."""

from __future__ import annotations

import json

import jsonschema
import pytest

from subway.frontend.errors import APIError
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.tool_parsers import CallPiece, HermesParser, ToolParser
from subway.frontend.tools import check_tools, tool_grammar, tool_mode

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain on day 3"},
]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


def prompt_text(req: ChatCompletionRequest, tokenizer) -> str:
    from subway.frontend.chat import chat_prompt
    from subway.frontend.inputs import Limits

    return chat_prompt(req, tokenizer, Limits(4096, len(tokenizer))).text


# ---------------------------------------------------------------- rendering


def test_a_template_without_tools_gets_them_in_a_hermes_system_prompt(tokenizer):
    text = prompt_text(chat(tools=TOOLS), tokenizer)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(t) for t in listed] == TOOLS
    assert text.startswith("<|im_start|>system\n") and "<tool_call>" in text
    assert "SmolLM" not in text  # our system message replaced the template's default
    assert "<tools>" not in prompt_text(chat(), tokenizer)


def test_the_tools_join_the_first_system_message(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    text = prompt_text(req, tokenizer)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\nYou may call")
    assert text.count("<|im_start|>system") == 1


def test_tool_choice_none_renders_no_tools(tokenizer):
    assert "<tools>" not in prompt_text(chat(tools=TOOLS, tool_choice="none"), tokenizer)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        assert "<tools>" in prompt_text(chat(tools=TOOLS, tool_choice=choice), tokenizer)


def test_calls_and_results_in_the_conversation_render_as_blocks(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY})
    text = prompt_text(req, tokenizer)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    responses = (
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
        "<tool_response>\nrain on day 3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.endswith(responses)


NATIVE = (
    "{% if tools %}TOOLS {{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.days }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them_as_they_are(tokenizer):
    req = ChatCompletionRequest.model_validate(
        {"messages": HISTORY, "tools": TOOLS, "chat_template": NATIVE}
    )
    lines = prompt_text(req, tokenizer).splitlines()
    assert json.loads(lines[0].removeprefix("TOOLS ")) == TOOLS
    # The arguments reach the template as an object; content None as "".
    assert lines[3] == "assistant: [call_1 get_weather 3]"
    assert lines[4:] == ["tool: sunny, 21 C(call_1)", "tool: rain on day 3(call_2)"]


# ---------------------------------------------------------------- checks and constraints


def test_tool_choice_defaults():
    assert tool_mode(chat()) == "none" and tool_mode(chat(tools=TOOLS)) == "auto"
    assert tool_mode(chat(tool_choice="auto")) == "none"
    assert tool_grammar(chat(tools=TOOLS)) is None
    assert tool_grammar(chat(tools=TOOLS, tool_choice="none")) is None


def test_forced_calls_are_a_structural_tag_in_the_format_asked():
    import xgrammar as xgr

    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for fmt in ("hermes", "qwen3_coder"):
            grammar = tool_grammar(chat(tools=TOOLS, tool_choice=choice), fmt)
            assert grammar is not None and grammar.kind == "structural_tag"
            xgr.Grammar.from_structural_tag(grammar.spec)
            tag = json.loads(grammar.spec)["format"]
            names = [t["begin"] for t in tag["tags"]]
            assert len(names) == (2 if choice == "required" else 1)
            assert all(("<function=" in n) == (fmt == "qwen3_coder") for n in names)
    single = tool_grammar(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert json.loads(single.spec)["format"]["stop_after_first"] is True


def test_the_job_carries_the_tool_constraint(tokenizer):
    from subway.frontend.chat import chat_job
    from subway.frontend.inputs import Limits
    from subway.ipc.messages import Grammar

    limits = Limits(4096, len(tokenizer))
    for choice in ("required", {"function": {"name": "get_time"}}):
        req = chat(tools=TOOLS, tool_choice=choice)
        assert chat_job(req, tokenizer, limits).sampling[0].grammar == tool_grammar(req)
        pythonic = Limits(4096, len(tokenizer), tool_call_parser="pythonic")
        assert chat_job(req, tokenizer, pythonic).sampling[0].grammar == tool_grammar(
            req, "pythonic"
        )
    auto = chat(tools=TOOLS, structured_outputs={"regex": "a+"})  # the request's own
    assert chat_job(auto, tokenizer, limits).sampling[0].grammar == Grammar("regex", "a+")
    assert chat_job(chat(tools=TOOLS), tokenizer, limits).sampling[0].grammar is None


BAD_REQUESTS = [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
    {"tools": [{"function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
    {"tools": [TOOLS[0], TOOLS[0]]},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a+"}},
    {"tools": TOOLS, "tool_choice": {"function": {"name": "get_time"}}, "guided_regex": "a"},
]


@pytest.mark.parametrize("fields", BAD_REQUESTS)
def test_bad_tool_requests_are_400s(fields):
    with pytest.raises(APIError) as e:
        check_tools(chat(**fields))
    assert e.value.status == 400


def test_auto_with_structured_outputs_is_allowed():
    check_tools(chat(tools=TOOLS, structured_outputs={"regex": "a+"}))
    check_tools(chat(tools=TOOLS, tool_choice="required", response_format={"type": "text"}))


# ---------------------------------------------------------------- parsing the output


def block(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls (name, arguments) of an output fed in `pieces`, joined by index."""
    out = [p for text in pieces for p in parser.feed(text)] + parser.finish()
    content = "".join(p for p in out if isinstance(p, str))
    calls: list[list[str]] = []
    for p in out:
        if isinstance(p, CallPiece):
            if p.name is not None:
                assert p.index == len(calls)
                calls.append([p.name, p.arguments])
            else:
                calls[p.index][1] += p.arguments
    return content, [(n, a) for n, a in calls]


HERMES = [
    ("Hello there", "Hello there", []),
    ("   ", "   ", []),
    (block("f", {"a": 1}), "", [("f", '{"a": 1}')]),
    (
        f"Let me look.\n{block('f', {'a': 'x'})}\n{block('g', {})}\n",
        "Let me look.\n",
        [("f", '{"a": "x"}'), ("g", "{}")],
    ),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (f"\n{block('f', {})} and more", " and more", [("f", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {"b": [1]}}\n', "", [("f", '{"b": [1]}')]),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    ("a < b <tool", "a < b <tool", []),
    ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
    ('<tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call>', "", [("f", '{"q": "é"}')]),
    (
        f" {block('f', {})}\n<tool_call>bad</tool_call>",
        "\n<tool_call>bad</tool_call>",
        [("f", "{}")],
    ),
]


def splits(text: str):
    """The text whole, in two at every point, in three, and one character at a time."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text), 3):
        yield [text[:i], text[i : i + 5], text[i + 5 :]]
    yield list(text)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_calls_are_found_however_the_text_is_cut(text, content, calls):
    for pieces in splits(text):
        assert run(HermesParser(), pieces) == (content, calls), pieces


def test_content_streams_before_a_call_and_only_a_marker_prefix_waits():
    parser = HermesParser()
    assert parser.feed("Sure thing <to") == ["Sure thing "]
    assert parser.feed("ol_call>\n{") == []
    assert parser.feed('"name": "f"}\n</tool_call>') == [CallPiece(0, "{}", "f")]
    assert parser.feed("\n") == [] and parser.finish() == []
    parser = HermesParser()
    assert parser.feed("<to") == [] and parser.feed("p") == ["<top"]


# ---------------------------------------------------------------- end to end
#
# Every request below runs at once, in one fixture (`results`): one batch on the engine,
# so the module stays short; each test then reads its own answers.


@pytest.fixture(scope="module")
def server(servers, default_model):
    from serving import DEFAULT_FLAGS

    return servers.get(default_model, *DEFAULT_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def answers(client, stream: bool, **fields) -> list:
    """Each choice's message and finish_reason, streamed ones assembled by the client's own
    stream state (calls joined by index), as `openai` users get them."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    body = {"model": "m", "messages": fields.pop("messages", ASK), **fields}
    extra = {k: body.pop(k) for k in ("structured_outputs",) if k in body}
    if not stream:
        return client.chat.completions.create(**body, extra_body=extra).choices
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**body, extra_body=extra, stream=True):
        for c in chunk.choices:
            for piece in c.delta.tool_calls or []:
                first = piece.function is not None and piece.function.name is not None
                assert (piece.id is not None) == first and (piece.type is not None) == first
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices


def literal(text: str) -> str:
    """A regex that matches `text` alone."""
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in text)


FORCED_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
CONSTRAINED = {
    "required": "required",
    "get_weather": {"type": "function", "function": {"name": "get_weather"}},
    "get_time": {"type": "function", "function": {"name": "get_time"}},
}
MODES = ("whole", "stream")


def requests() -> dict[tuple[str, str, str], dict]:
    """(what, whole or stream, how) -> the request's fields."""
    out = {}
    for mode in MODES:
        seed = MODES.index(mode) + 1
        for what, choice in CONSTRAINED.items():
            fields = dict(tools=TOOLS, tool_choice=choice, max_tokens=96)
            out[what, mode, "greedy"] = dict(fields, temperature=0.0)
            out[what, mode, "sampled"] = dict(fields, temperature=0.8, seed=seed, n=3)
        out["single", mode, "sampled"] = dict(tools=TOOLS, tool_choice="required", max_tokens=96,
                                              parallel_tool_calls=False, temperature=0.8, seed=3, n=3)  # fmt: skip
        # Greedy, and room for any tokenization of the forced text (one token a character at
        # worst): sampled, the grammar lets the model spell it in more than 60 tokens.
        forced = {"regex": literal("Sure.\n" + FORCED_CALL)}
        room = dict(temperature=0.0, max_tokens=len(FORCED_CALL) + 16)
        out["auto", mode, "text+call"] = dict(tools=TOOLS, structured_outputs=forced, **room)
        forced = {"regex": literal(FORCED_CALL)}
        out["auto", mode, "call"] = dict(tools=TOOLS, structured_outputs=forced, **room)
        out["none", mode, "call"] = dict(tools=TOOLS, tool_choice="none", structured_outputs=forced,
                                         **room)  # fmt: skip
        out["none", mode, "sampled"] = dict(tools=TOOLS, tool_choice="none", max_tokens=24,
                                            temperature=0.8, seed=seed, n=2)  # fmt: skip
    out["history", "whole", "tools"] = dict(messages=HISTORY, tools=TOOLS, max_tokens=16)
    out["history", "whole", "plain"] = dict(messages=HISTORY, max_tokens=16)
    return out


@pytest.fixture(scope="module")
def results(client) -> dict[tuple[str, str, str], list]:
    from concurrent.futures import ThreadPoolExecutor

    asked = requests()
    with ThreadPoolExecutor(len(asked)) as pool:
        futures = {
            key: pool.submit(answers, client, key[1] == "stream", **fields)
            for key, fields in asked.items()
        }
        return {key: f.result() for key, f in futures.items()}


def calls_of(choice) -> list[tuple[str, dict]]:
    calls = choice.message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def check_valid_calls(choices, only: str | None = None) -> None:
    for choice in choices:
        calls = calls_of(choice)
        assert calls, choice
        for name, args in calls:
            assert name == only if only else name in SCHEMAS
            jsonschema.validate(args, SCHEMAS[name])
        assert choice.finish_reason in ("tool_calls", "length"), choice.finish_reason
        assert choice.finish_reason == "length" or not choice.message.content


@pytest.mark.parametrize("mode", MODES)
def test_required_calls_always_validate(results, mode):
    for how in ("greedy", "sampled"):
        choices = results["required", mode, how]
        assert len(choices) == (3 if how == "sampled" else 1)
        check_valid_calls(choices)
    single = results["single", mode, "sampled"]
    check_valid_calls(single)
    assert all(len(c.message.tool_calls) == 1 for c in single)
    assert all(c.finish_reason == "tool_calls" for c in single)


@pytest.mark.parametrize("mode", MODES)
def test_a_named_function_is_always_called(results, mode):
    for name in ("get_weather", "get_time"):
        for how in ("greedy", "sampled"):
            choices = results[name, mode, how]
            check_valid_calls(choices, only=name)
            assert all(len(c.message.tool_calls) == 1 for c in choices)


def test_streamed_and_whole_greedy_calls_agree(results):
    for what in CONSTRAINED:
        whole, streamed = results[what, "whole", "greedy"], results[what, "stream", "greedy"]
        assert calls_of(whole[0]) == calls_of(streamed[0])


@pytest.mark.parametrize("mode", MODES)
def test_auto_parses_a_call_the_model_writes(results, mode):
    for how, content in (("text+call", "Sure.\n"), ("call", None)):
        (choice,) = results["auto", mode, how]
        assert calls_of(choice) == [("get_weather", {"city": "Paris", "days": 3})]
        # A stream's first chunk has content "" (as OpenAI's): "" and None are alike there.
        assert (choice.message.content or None) == content
        assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("mode", MODES)
def test_none_never_makes_calls(results, mode):
    (choice,) = results["none", mode, "call"]
    assert choice.message.content == FORCED_CALL and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    choices = results["none", mode, "sampled"]
    assert len(choices) == 2
    assert all(not c.message.tool_calls and c.finish_reason != "tool_calls" for c in choices)


def test_a_conversation_with_calls_and_results_is_answered(results):
    for how in ("tools", "plain"):
        (choice,) = results["history", "whole", how]
        assert choice.finish_reason in ("stop", "length", "tool_calls")


MALFORMED = [
    {"tools": "get_weather"},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "other", "function": WEATHER}]},
    {"tools": [{"type": "function", "function": {**WEATHER, "name": "get weather"}}]},
    {"tools": [{"type": "function", "function": {**WEATHER, "parameters": "object"}}]},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": {"type": "function"}},
]


def test_bad_tool_requests_get_400_and_the_server_serves_on(server):
    import httpx

    for fields in BAD_REQUESTS + MALFORMED:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **fields})
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    body = {"messages": ASK, "max_tokens": 2, "tools": TOOLS}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
