"""`--tool-call-parser`: the formats of tool calls a model writes freely (`tool_formats.py`).

Each parser gives the same calls and content however its output is cut: whole, in
two at every point, in three, and a character at a time; a malformed call is
content, never an error. `ChatView` renders a `pythonic` answer's calls in
OpenAI's shape, streamed and whole alike.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_reasoning import FakeGroup  # what ChatView reads of a ChoiceGroup
from test_tools import splits  # the text whole, at every split, in three, char by char

from subway.frontend.chat import ChatView
from subway.frontend.inputs import Job, Prompt
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.tool_formats import (
    PARSERS,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    auto_parser,
)
from subway.frontend.tool_parsers import MAX_JSON_DEPTH, CallPiece, HermesParser, ToolParser
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


def test_the_flag_picks_the_parser():
    assert set(PARSERS) == set(
        ServerConfig.__dataclass_fields__["tool_call_parser"].metadata["choices"]
    )
    assert ServerConfig().tool_call_parser == "hermes"
    assert isinstance(auto_parser("hermes"), HermesParser)
    assert isinstance(auto_parser("pythonic"), PythonicParser)


# ---------------------------------------------------------------- ChatView


def test_a_pythonic_answer_streamed_and_whole_gives_the_same_calls():
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=[tool])
    job = Job([Prompt([1, 2, 3])], [SamplingParams()])
    v = ChatView(req, job, "chatcmpl-x", "m", None, ServerConfig(tool_call_parser="pythonic"))
    text = '[get_weather(city="Paris", days=3), get_weather(city="Zürich")]'
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
