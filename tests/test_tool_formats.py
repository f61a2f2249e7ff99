"""`--tool-call-parser`: the formats of tool calls a model writes freely (`tool_formats.py`).

Each parser gives the same calls and content however its output is cut: whole, in
two at every point, in three, and a character at a time; a malformed call is
content, never an error. `qwen3_coder` types its text values by the request's
tools' schemas. `auto` picks the format by the markers of the chat template.
`ChatView` renders a `pythonic` and a `qwen3_coder` answer's calls in OpenAI's
shape, streamed and whole alike.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from test_reasoning import FakeGroup  # what ChatView reads of a ChoiceGroup
from test_tools import splits  # the text whole, at every split, in three, char by char

from subway.frontend.chat import ChatView
from subway.frontend.inputs import Job, Prompt
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.tool_format_xml import Qwen3CoderParser, typed_value
from subway.frontend.tool_formats import (
    PARSERS,
    TEMPLATE_MARKERS,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    auto_parser,
    template_format,
)
from subway.frontend.tool_parsers import MAX_JSON_DEPTH, CallPiece, HermesParser, ToolParser
from subway.frontend.tools import call_format, tool_parser
from subway.ipc.config import ServerConfig
from subway.ipc.messages import SamplingParams


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Content and calls (name, arguments parsed) of an output fed in `pieces`."""
    out = [p for text in pieces for p in parser.feed(text)] + parser.finish()
    content = "".join(p for p in out if isinstance(p, str))
    calls: list[list] = []
    for p in out:
        if isinstance(p, CallPiece):
            if p.name is not None:
                assert p.index == len(calls)
                calls.append([p.name, p.arguments])
            else:
                calls[p.index][1] += p.arguments
    return content, [(n, json.loads(a)) for n, a in calls]


NESTED = {"q": "pensée 中文 🙂", "opts": {"deep": [1, {"x": None}], "ok": True}, "n": -2.5}
DEEP = "[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5)

LLAMA3 = [
    ("Hello there", "Hello there", []),
    ("   ", "   ", []),
    ("", "", []),
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": "x"}}', "", [("f", {"a": "x"})]),
    (
        '\n{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}\n',
        "",
        [("f", {}), ("g", {"b": [1]})],
    ),
    (
        '{"name": "w", "parameters": ' + json.dumps(NESTED, ensure_ascii=False) + "}",
        "",
        [("w", NESTED)],
    ),
    ('{"name": "f", "parameters": {"s": "}{;\\"]"}}', "", [("f", {"s": '}{;"]'})]),
    ('{"name": "f"} then text', " then text", [("f", {})]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),
    ('{"name": "f"}; {"name": 3}', '; {"name": 3}', [("f", {})]),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|pyth", "<|pyth", []),
    ("<|pyx", "<|pyx", []),
    ('Sure: {"name": "f"}', 'Sure: {"name": "f"}', []),
    ('{"name": "f", "parameters": ' + DEEP + "}", '{"name": "f", "parameters": ' + DEEP + "}", []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
]

MISTRAL = [
    ("Hello there", "Hello there", []),
    ("", "", []),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
    (
        'Let me check. [TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
        + json.dumps(NESTED, ensure_ascii=False)
        + "}]\n",
        "Let me check. ",
        [("f", {}), ("g", NESTED)],
    ),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}] Done.', " Done.", [("f", {})]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    (
        '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{"s": "]["}',
        "",
        [("f", {"a": 1}), ("g", {"s": "]["})],
    ),
    ('[TOOL_CALLS][{"name": "f", "arg', '[TOOL_CALLS][{"name": "f", "arg', []),
    ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, 7]', ", 7]", [("f", {})]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, ', "", [("f", {})]),
    ("a [TOOL_CALL b", "a [TOOL_CALL b", []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS]f[1]", "[TOOL_CALLS]f[1]", []),
    ("[TOOL_CALLS][" + DEEP + "]", "[TOOL_CALLS][" + DEEP + "]", []),
]

PYTHONIC = [
    ("Hello there", "Hello there", []),
    ("  ", "  ", []),
    ('[get_weather(city="Paris", days=3)]', "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        " [f(), g(s='a, b]) (', n=None, ok=False, xs=[1, 2.5], d={'k': {'v': [True]}})]\n",
        "",
        [
            ("f", {}),
            (
                "g",
                {
                    "s": "a, b]) (",
                    "n": None,
                    "ok": False,
                    "xs": [1, 2.5],
                    "d": {"k": {"v": [True]}},
                },
            ),
        ],
    ),
    ("[f(q=" + repr(NESTED) + ")]", "", [("f", {"q": NESTED})]),
    ('[f(s="\\"]")]', "", [("f", {"s": '"]'})]),
    ("[f(a=1),]", "", [("f", {"a": 1})]),
    ("[f(a=1)] That is all.", " That is all.", [("f", {"a": 1})]),
    ("[f(a=1), g(b=x)]", ", g(b=x)]", [("f", {"a": 1})]),
    ("[f(a=1), g(b=2)", "", [("f", {"a": 1}), ("g", {"b": 2})]),
    ("[f(a=1), g(b=", ", g(b=", [("f", {"a": 1})]),
    ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("[Note] read this", "[Note] read this", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(a=1+x)]", "[f(a=1+x)]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),
    ("[os.system(c='x')]", "[os.system(c='x')]", []),
    ("[]", "[]", []),
    ("[f())]", "[f())]", []),
    ("Answer: [f()]", "Answer: [f()]", []),
    ("[f(a=" + DEEP + ")]", "[f(a=" + DEEP + ")]", []),
]


def xml(name: str, **params: str) -> str:
    """A Qwen3-Coder call block, as its chat template writes one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "temp": {"type": "number"},
            "metric": {"type": "boolean"},
            "opts": {"type": "object"},
            "tags": {"type": "array"},
            "limit": {"type": ["integer", "null"]},
            "unit": {"enum": ["C", "F"]},
        },
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]


def tools_of(tools: list[dict]) -> list:
    """The request's tools as a parser takes them."""
    messages = [{"role": "user", "content": "Hi"}]
    return ChatCompletionRequest(messages=messages, tools=tools).tools or []


OPEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3"
QWEN3_CODER = [
    ("Hello there", "Hello there", []),
    ("", "", []),
    (
        xml("get_weather", city="Paris", days="3"),
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "Let me check.\n" + xml("get_weather", city="Zürich") + "\n" + xml("get_weather", days="2"),
        "Let me check.\n",
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"days": 2})],
    ),
    (
        xml(
            "get_weather",
            temp="-2.5",
            metric="True",
            opts='{"deep": [1, {"x": null}]}',
            tags="['a', \"b\"]",
            limit="null",
            unit="C",
        ),
        "",
        [
            (
                "get_weather",
                {
                    "temp": -2.5,
                    "metric": True,
                    "opts": {"deep": [1, {"x": None}]},
                    "tags": ["a", "b"],
                    "limit": None,
                    "unit": "C",
                },
            )
        ],
    ),
    (
        xml("get_weather", days="three", temp="NaN", metric="yes", opts="[1]", tags="x", city="42"),
        "",
        [
            (
                "get_weather",
                {
                    "days": "three",
                    "temp": "NaN",
                    "metric": "yes",
                    "opts": "[1]",
                    "tags": "x",
                    "city": "42",
                },
            )
        ],
    ),
    (xml("get_weather", opts=DEEP), "", [("get_weather", {"opts": DEEP})]),
    (
        xml("other", n="3", s="\nline 1\n  line 2\n"),
        "",
        [("other", {"n": "3", "s": "\nline 1\n  line 2\n"})],
    ),
    (xml("get_weather"), "", [("get_weather", {})]),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n<parameter=city>\nParis\n"
        "</function>\n<function=f>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"days": 4, "city": "Paris"}), ("f", {})],
    ),
    (
        "Sure. <function=get_weather>\n<parameter=days>\n1\n</parameter>\n</function> Done.",
        "Sure.  Done.",
        [("get_weather", {"days": 1})],
    ),
    (OPEN_CALL + "\n</parameter>\n</function>\n", "", [("get_weather", {"days": 3})]),
    (OPEN_CALL, OPEN_CALL, []),
    (
        "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n",
        "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n",
        [],
    ),
    (
        "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        [],
    ),
    (
        "<tool_call>\n<function=f>\nsay 1\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\nsay 1\n</function>\n</tool_call>",
        [],
    ),
    (
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
        [],
    ),
    (
        "<tool_call><function=f></function> and text</tool_call>",
        "<tool_call><function=f></function> and text</tool_call>",
        [],
    ),
    (
        xml("f") + "\n<tool_call>bad</tool_call>",
        "\n<tool_call>bad</tool_call>",
        [("f", {})],
    ),
    ("a < b <tool_ca", "a < b <tool_ca", []),
    ("x <function", "x <function", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), QWEN3_CODER)
def test_qwen3_coder_calls_are_found_however_the_text_is_cut(text, content, calls):
    tools = tools_of(TOOLS)
    for pieces in splits(text):
        assert run(Qwen3CoderParser(tools), pieces) == (content, calls), pieces


def test_a_qwen3_coder_value_is_typed_by_its_schema():
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value("3.0", {"type": "integer"}) == 3
    assert typed_value("3.5", {"type": "integer"}) == "3.5"
    assert typed_value("true", {"type": "integer"}) == "true"
    assert typed_value("4.0", {"type": "number"}) == 4  # vLLM's
    assert typed_value("1e400", {"type": "number"}) == "1e400"
    assert typed_value("FALSE", {"type": "boolean"}) is False
    assert typed_value("Null", {"type": "string"}) is None  # vLLM's: null whatever the type
    assert typed_value("[1, 2]", {"type": "string"}) == "[1, 2]"
    assert typed_value("[1, 2]", None) == "[1, 2]"  # no schema: the text, as vLLM's
    assert typed_value("{1, 2}", {"type": "array"}) == "{1, 2}"  # a set is no JSON
    assert typed_value("{'a': (1, 2)}", {"type": "object"}) == {"a": [1, 2]}
    assert typed_value("x", {"type": ["integer", "string"]}) == "x"
    assert typed_value("7", {"type": ["integer", "string"]}) == 7
    assert typed_value("7", {"type": ["string", "integer"]}) == "7"
    assert typed_value("7", {"anyOf": [{"type": "integer"}]}) == "7"


def test_qwen3_coder_reads_deep_and_long_output_in_one_pass():
    deep = "[" * 100_000 + "]" * 100_000  # no RecursionError: the text of the value
    p = Qwen3CoderParser(tools_of(TOOLS))
    out = p.feed(xml("get_weather", opts=deep, tags=deep)) + p.finish()
    assert out == [CallPiece(0, json.dumps({"opts": deep, "tags": deep}), "get_weather")]
    n = 20_000  # calls in one block, and as many bare ones, in one piece
    calls = "".join(
        f"<function=f>\n<parameter=i>\n{i}\n</parameter>\n</function>" for i in range(n)
    )
    p = Qwen3CoderParser()
    out = p.feed(f"<tool_call>{calls}</tool_call>{calls}") + p.finish()
    assert [(c.index, c.name, c.arguments) for c in out] == [
        (i, "f", json.dumps({"i": str(i % n)})) for i in range(2 * n)
    ]


@pytest.mark.parametrize(
    ("cls", "text", "content", "calls"),
    [(Llama3JsonParser, *c) for c in LLAMA3]
    + [(MistralParser, *c) for c in MISTRAL]
    + [(PythonicParser, *c) for c in PYTHONIC],
)
def test_calls_are_found_however_the_text_is_cut(cls, text, content, calls):
    for pieces in splits(text):
        assert run(cls(), pieces) == (content, calls), pieces


def test_calls_stream_as_they_close_and_content_as_it_comes():
    p = PythonicParser()
    assert p.feed("[f(a=1), g(") == [CallPiece(0, '{"a": 1}', "f")]
    assert p.feed(")] ok") == [CallPiece(1, "{}", "g"), " ok"]
    p = MistralParser()
    assert p.feed("Sure [TOOL") == ["Sure "]
    assert p.feed('_CALLS]f{"a": 1}') == [CallPiece(0, '{"a": 1}', "f")]
    p = Llama3JsonParser()
    assert p.feed("Hi") == ["Hi"] and p.feed(' {"name": "f"}') == [' {"name": "f"}']
    p = Qwen3CoderParser()
    assert p.feed("Hi <tool") == ["Hi "]
    assert p.feed("_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>") == []
    assert p.feed("\n</tool_call>\n<func") == [CallPiece(0, '{"a": "1"}', "f")]
    assert p.feed("tion=g></function>") == [CallPiece(1, "{}", "g")]


def test_the_flag_picks_the_parser():
    assert set(PARSERS) | {"auto"} == set(
        ServerConfig.__dataclass_fields__["tool_call_parser"].metadata["choices"]
    )
    assert ServerConfig().tool_call_parser == "hermes"
    assert isinstance(auto_parser("hermes"), HermesParser)
    assert isinstance(auto_parser("pythonic"), PythonicParser)
    assert isinstance(auto_parser("qwen3_coder", tools_of(TOOLS)), Qwen3CoderParser)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert isinstance(tool_parser(req, "mistral"), MistralParser)


# ---------------------------------------------------------------- auto

TEMPLATES = {  # a template that takes tools, and what it tells the model to write
    "qwen3_coder": "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>",
    "mistral": "{{ '[TOOL_CALLS]' }}",
    "pythonic": "Respond in the format [func_name1(params_name1=params_value1, ...)]",
    "llama3_json": "{{- '<|python_tag|>' + tool_call.name }}",
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}',
}


def tokenizer_with(template) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_auto_takes_the_format_the_template_asks_for(name):
    template = "{% if tools %}" + TEMPLATES[name] + "{% endif %}"
    assert template_format(template) == name
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert call_format(req, "auto", tokenizer_with(template)) == name
    named = {"default": "{{ messages }}", "tool_use": template}  # a tokenizer's named templates
    assert call_format(req, "auto", tokenizer_with(named)) == name
    assert type(tool_parser(req, "auto", tokenizer_with(template))) is PARSERS[name]
    assert call_format(req, name, tokenizer_with("{{ tools }}")) == name  # the flag's own
    own = ChatCompletionRequest(messages=req.messages, tools=TOOLS, chat_template=template)
    assert call_format(own, "auto") == name  # the request's own template, when trusted


def test_auto_falls_back_to_hermes():
    assert template_format("{{ tools }} plain") == "hermes"
    assert template_format('{{ tools }} "parameters": dictionary of argument name') == "llama3_json"
    assert {name for name, _ in TEMPLATE_MARKERS} == set(PARSERS)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    # a template that does not take tools gets our Hermes system prompt, whatever it says
    assert call_format(req, "auto", tokenizer_with("[TOOL_CALLS] {{ messages }}")) == "hermes"
    assert call_format(req, "auto", tokenizer_with(None)) == "hermes"
    assert call_format(req, "auto") == "hermes"


def test_auto_gives_the_default_model_hermes(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert call_format(req, "auto", tokenizer) == "hermes"
    assert type(tool_parser(req, "auto", tokenizer)) is HermesParser


# ---------------------------------------------------------------- ChatView


ANSWERS = {
    "pythonic": '[get_weather(city="Paris", days=3), get_weather(city="Zürich")]',
    "qwen3_coder": xml("get_weather", city="Paris", days="3") + xml("get_weather", city="Zürich"),
}


@pytest.mark.parametrize("flag", sorted(ANSWERS))
def test_an_answer_streamed_and_whole_gives_the_same_calls(flag):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS)
    job = Job([Prompt([1, 2, 3])], [SamplingParams()])
    v = ChatView(req, job, "chatcmpl-x", "m", None, ServerConfig(tool_call_parser=flag))
    text = ANSWERS[flag]
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]

    async def render():
        whole = await v.whole(FakeGroup(pieces))
        chunks = [c async for c in v.chunks(FakeGroup(pieces))]
        return json.loads(whole.model_dump_json()), [
            json.loads(c.model_dump_json()) for c in chunks
        ]

    whole, chunks = asyncio.run(render())
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    expected = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Zürich"})]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == expected
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    deltas = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls") or []]
    streamed: dict[int, list] = {}
    for t in deltas:
        if t["function"].get("name"):
            assert t["id"].startswith("call_") and t["type"] == "function"
            streamed[t["index"]] = [t["function"]["name"], ""]
        streamed[t["index"]][1] += t["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in streamed.values()] == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not "".join(ch["delta"].get("content") or "" for c in chunks[1:] for ch in c["choices"])
