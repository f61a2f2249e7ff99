"""`--reasoning-parser`: a chat answer's `<think>...</think>` apart, as `reasoning_content`.

The parsers (`frontend/reasoning.py`) give the same reasoning and content however
the output is cut into pieces: at every split point, a character at a time, and
at random cuts, for outputs with and without a think block, a marker split
across pieces, text that only looks like the start of a marker, and unicode.
`ChatView` renders a choice's events with the reasoning apart and the tool
calls parsed from the answer only, streamed and whole alike. End to end, the
tiny Llama is made to write a think block by a regex: with the parser its
reasoning and answer come apart, streamed or not, and equal the plain server's
greedy text around the markers; without the flag the answer is as it always
was, with no `reasoning_content` key at all. `chat_template_kwargs` reach the
chat template.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from subway.frontend.chat import ChatView, chat_prompt
from subway.frontend.choices import ChoiceEvent
from subway.frontend.inputs import Job, Limits, Prompt
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.reasoning import PARSERS, held, reasoning_parser, split
from subway.ipc.config import ServerConfig
from subway.ipc.messages import SamplingParams

from serving import TINY_FLAGS

# Output -> (deepseek_r1's, qwen3's) (reasoning, content).
CASES = {
    "<think>abc</think>def": (("abc", "def"), ("abc", "def")),
    "<think>\nstep one\nstep two\n</think>\n\nThe answer.": (
        ("\nstep one\nstep two\n", "\n\nThe answer."),
        ("\nstep one\nstep two\n", "\n\nThe answer."),
    ),
    " \n<think>x</think>y": (("x", "y"), ("x", "y")),  # blank before <think> goes with it
    "no start tag</think>answer": (("no start tag", "answer"), ("", "no start tag</think>answer")),
    "plain answer, no block": (("plain answer, no block", ""), ("", "plain answer, no block")),
    "<think>cut by length": (("cut by length", ""), ("cut by length", "")),
    "<think></think>": (("", ""), ("", "")),
    "<think></think>only answer": (("", "only answer"), ("", "only answer")),
    "": (("", ""), ("", "")),
    "  \n": (("  \n", ""), ("", "  \n")),
    "<thin": (("<thin", ""), ("", "<thin")),
    " <think": ((" <think", ""), ("", " <think")),
    "<thinking>a</think>b": (("<thinking>a", "b"), ("", "<thinking>a</think>b")),
    "</thin x and </think> y": (("</thin x and ", " y"), ("", "</thin x and </think> y")),
    "<think>a </thin x b</think>c": (("a </thin x b", "c"), ("a </thin x b", "c")),
    "<think>pensée 中文 🙂</think>réponse 🙂": (("pensée 中文 🙂", "réponse 🙂"),) * 2,
    "<think>a</think>b</think>c<think>d": (("a", "b</think>c<think>d"),) * 2,
    "<think><think>a</think>b": (("<think>a", "b"),) * 2,
    "x<think>a</think>b": (("x<think>a", "b"), ("", "x<think>a</think>b")),
    "<<think>a</think>b": (("<<think>a", "b"), ("", "<<think>a</think>b")),
    "</think>": (("", ""), ("", "</think>")),
    "<think>a<</think>b": (("a<", "b"),) * 2,
    "<think>a</</think>b</": (("a</", "b</"),) * 2,
    "<think>a</think": (("a</think", ""),) * 2,
}


def fed(name: str, pieces: list[str], constrained: bool = False) -> tuple[str, str]:
    parser = reasoning_parser(name, constrained)
    assert parser is not None
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("name", PARSERS)
def test_the_split_is_as_documented(name):
    for text, expected in CASES.items():
        assert split(name, text) == expected[PARSERS.index(name)], (name, text)


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("name", PARSERS)
def test_every_cut_gives_the_same_split(name, constrained):
    rng = random.Random(0)
    for text in CASES:
        whole = split(name, text, constrained)
        assert fed(name, [text], constrained) == whole
        for i in range(len(text) + 1):
            assert fed(name, [text[:i], text[i:]], constrained) == whole, (text, i)
        assert fed(name, list(text), constrained) == whole, text
        for _ in range(20):
            cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert fed(name, pieces, constrained) == whole, pieces


def test_a_constrained_deepseek_output_reasons_only_after_a_think_at_its_start():
    """A grammar from the first token leaves no room to think: deepseek_r1 then splits as
    qwen3 does (a JSON answer is content, not reasoning)."""
    for text in CASES:
        assert split("deepseek_r1", text, constrained=True) == split("qwen3", text), text
    assert split("deepseek_r1", '{"a": 1}', constrained=True) == ("", '{"a": 1}')


def test_only_what_may_begin_a_marker_is_held_back():
    assert held("abc</thi", "</think>") == 5 and held("abc</thin x", "</think>") == 0
    assert held("a<", "</think>") == 1 and held("</think", "</think>") == 7
    p = reasoning_parser("qwen3")
    assert p.feed("<th") == ("", "")  # may be <think>
    assert p.feed("ink>ab") == ("ab", "")
    assert p.feed("c</thi") == ("c", "")
    assert p.feed("n x") == ("</thin x", "")
    assert p.feed("</think>") == ("", "")
    assert p.feed("an") == ("", "an")
    assert p.finish() == ("", "")
    p = reasoning_parser("qwen3")
    assert p.feed("hello") == ("", "hello")  # not <think>: content at once
    p = reasoning_parser("deepseek_r1")
    assert p.feed("  ") == ("", "")  # blank: it may still open with <think>
    assert p.feed("hmm") == ("  hmm", "")
    assert p.finish() == ("", "")
    assert reasoning_parser("") is None
    with pytest.raises(ValueError):
        reasoning_parser("granite")


# ---------------------------------------------------------------- ChatView


class FakeGroup:
    """What `ChatView` reads of a `ChoiceGroup`: one choice's events."""

    max_bytes = 0

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    async def events(self):
        for k, text in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            yield ChoiceEvent(0, text, [k], finish_reason="stop" if last else None)

    def close(self) -> None:
        pass


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def view(parser: str, tools: bool = False) -> ChatView:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER] if tools else None
    )
    job = Job([Prompt([1, 2, 3])], [SamplingParams()])
    return ChatView(req, job, "chatcmpl-x", "m", None, ServerConfig(reasoning_parser=parser))


def rendered(v: ChatView, pieces: list[str]) -> tuple[dict, list[dict]]:
    """The whole answer's message and finish reason, and the streamed chunks' choices."""

    async def run():
        whole = await v.whole(FakeGroup(pieces))
        chunks = [c async for c in v.chunks(FakeGroup(pieces))]
        return json.loads(whole.model_dump_json()), [
            json.loads(c.model_dump_json()) for c in chunks
        ]

    whole, chunks = asyncio.run(run())
    return whole["choices"][0], [c["choices"][0] for c in chunks if c["choices"]]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in chunks)


def test_tool_calls_are_parsed_from_the_answer_only():
    pieces = ['<think>Call <tool_call>{"name": "x"}', "</tool_call>? Yes.</th", "ink>\n", CALL]
    whole, chunks = rendered(view("qwen3", tools=True), pieces)
    assert (
        whole["message"]["reasoning_content"] == 'Call <tool_call>{"name": "x"}</tool_call>? Yes.'
    )
    assert whole["message"]["content"] is None
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert whole["finish_reason"] == chunks[-1]["finish_reason"] == "tool_calls"
    assert joined(chunks, "reasoning_content") == whole["message"]["reasoning_content"]
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]
    assert not joined(chunks, "content")
    for c in chunks[1:-1]:  # between the role and the finish: never an empty delta
        assert c["delta"], c


@pytest.mark.parametrize("parser", ["", "qwen3", "deepseek_r1"])
def test_streamed_and_whole_agree(parser):
    pieces = ["<thi", "nk>a b", "</think", ">c ", "d"]
    whole, chunks = rendered(view(parser), pieces)
    message = whole["message"]
    if not parser:  # as it always was: the whole text, and no reasoning_content key
        assert message == {
            "role": "assistant",
            "content": "<think>a b</think>c d",
            "tool_calls": [],
        }
        assert all("reasoning_content" not in c["delta"] for c in chunks)
    else:
        assert message["reasoning_content"] == "a b" and message["content"] == "c d"
    assert joined(chunks, "reasoning_content") == (message.get("reasoning_content") or "")
    assert joined(chunks, "content") == message["content"]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}


def test_reasoning_alone_leaves_a_null_content():
    whole, chunks = rendered(view("deepseek_r1"), ["still thinking", " when cut"])
    assert whole["message"]["reasoning_content"] == "still thinking when cut"
    assert whole["message"]["content"] is None
    whole, _ = rendered(view("qwen3"), ["just an answer"])
    assert whole["message"]["reasoning_content"] is None  # the key, null: vLLM's shape
    assert whole["message"]["content"] == "just an answer"


# ---------------------------------------------------------------- a grammar after the thinking

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"], "additionalProperties": False})  # fmt: skip


@pytest.fixture(scope="module")
def grammar_compiler(default_model):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok), max_threads=1)


def accepts(compiler, grammar, text: str) -> bool:
    """Whether `grammar` takes `text` whole, as the worker's matcher would."""
    import xgrammar as xgr

    from subway.worker.grammar import compile_grammar

    matcher = xgr.GrammarMatcher(compile_grammar(compiler, grammar))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    "think, text, ok",
    [
        ("open", 'step one < two </th no</think>\n\n{"a": 1}', True),
        ("open", '{"a": 1}', False),  # the prompt opened the block: it must close first
        ("open", 'x</think>not json', False),
        ("open", 'x</think></think>{"a": 1}', False),  # the first </think> ends it
        ("open", 'thinking, cut', False),
        ("optional", '{"a": 1}', True),
        ("optional", '<think>hm</think>\n{"a": 1}', True),
        ("optional", '<think>hm</think>\n\n\n\n{"a": 1}', False),  # blank run bounded
        ("optional", 'hm</think>{"a": 1}', False),
        ("", '<think>hm</think>{"a": 1}', False),
    ],
)  # fmt: skip
def test_a_json_grammar_holds_the_answer_after_the_thinking(grammar_compiler, think, text, ok):
    from subway.ipc.messages import Grammar

    assert accepts(grammar_compiler, Grammar("json_schema", SCHEMA, think=think), text) is ok


@pytest.mark.parametrize(
    "think, text, ok",
    [
        ("optional", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True),
        ("optional", '<think>hm</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True),
        ("open", 'hm</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True),
        ("open", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', False),
        ("optional", '<think>hm</think>\nno call', False),
    ],
)  # fmt: skip
def test_a_forced_call_follows_the_thinking(grammar_compiler, think, text, ok):
    import msgspec

    from subway.frontend.tool_grammars import forced_calls

    grammar = msgspec.structs.replace(forced_calls("hermes", [("f", {})], True), think=think)
    assert accepts(grammar_compiler, grammar, text) is ok


def test_an_unknown_think_is_refused(grammar_compiler):
    from subway.ipc.messages import Grammar
    from subway.worker.grammar import GrammarError, compile_grammar

    with pytest.raises(GrammarError):
        compile_grammar(grammar_compiler, Grammar("json_schema", SCHEMA, think="later"))


@pytest.mark.parametrize(
    "parser, fields, think",
    [
        ("deepseek_r1", {"response_format": {"type": "json_object"}}, "open"),
        ("qwen3", {"structured_outputs": {"json": {"type": "object"}}}, "optional"),
        ("qwen3", {"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": "required"}, "optional"),
        ("qwen3", {"structured_outputs": {"regex": "a+"}}, ""),  # as written: may spell it
        ("", {"response_format": {"type": "json_object"}}, ""),
    ],
)  # fmt: skip
def test_the_chat_job_puts_a_json_constraint_after_the_thinking(
    default_model, parser, fields, think
):
    from transformers import AutoTokenizer

    from subway.frontend.chat import chat_job

    tok = AutoTokenizer.from_pretrained(default_model)
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **fields}
    )
    job = chat_job(req, tok, Limits(2048, len(tok), reasoning_parser=parser))
    assert job.sampling[0].grammar.think == think


# ---------------------------------------------------------------- chat_template_kwargs


def test_chat_template_kwargs_reach_the_template(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}"
    )
    limits = Limits(max_model_len=2048, vocab_size=len(tok))

    def prompt(**kw) -> str:
        req = ChatCompletionRequest(
            messages=[{"role": "user", "content": "Hi"}], chat_template=template, **kw
        )
        return chat_prompt(req, tok, limits).text

    assert prompt() == "Hi\n"
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == "Hi\n"
    assert prompt(chat_template_kwargs={"enable_thinking": False}) == "Hi\n<think>\n\n</think>\n\n"


# ---------------------------------------------------------------- end to end

THINK = re.compile(r"<think>([a-z ]{3,30})</think>([a-z ]{3,30})")
REQUEST = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Think, then answer."}],
    "max_tokens": 64,
    "temperature": 0,
    "structured_outputs": {"regex": THINK.pattern},
}


@pytest.fixture(scope="module")
def urls(servers, tiny_models):
    """The plain server (the one other modules share) and one per parser, their grammar
    compilers started together (the first grammar of a server takes seconds of CPU)."""
    llama = tiny_models["llama"]
    flags = {"": ()} | {n: ("--reasoning-parser", n, "--grammar-workers", "1") for n in PARSERS}
    urls = {name: servers.get(llama, *TINY_FLAGS, *f).url for name, f in flags.items()}
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: post(url, REQUEST), urls.values()))
    return urls


def post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, body: dict) -> tuple[list[dict], dict]:
    """The chunks' choices (the role's first), and the usage of the last chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return [e["choices"][0] for e in events if e["choices"]], events[-1]["usage"]


def test_the_plain_server_answers_as_always(urls):
    out = post(urls[""], REQUEST)
    message = out["choices"][0]["message"]
    assert set(message) == {"role", "content", "tool_calls"}  # no reasoning_content key
    assert THINK.fullmatch(message["content"])
    chunks, _ = streamed(urls[""], REQUEST)
    assert all(set(c["delta"]) <= {"role", "content"} for c in chunks)
    assert joined(chunks, "content") == message["content"]


@pytest.mark.parametrize("name", PARSERS)
def test_the_think_block_comes_apart_streamed_or_not(urls, name):
    plain = post(urls[""], {**REQUEST, "logprobs": True})
    thought, answer = THINK.fullmatch(plain["choices"][0]["message"]["content"]).groups()
    out = post(urls[name], {**REQUEST, "logprobs": True})
    choice = out["choices"][0]
    assert choice["message"]["reasoning_content"] == thought
    assert choice["message"]["content"] == answer
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == plain["usage"]
    tokens = [[t["token"] for t in c["logprobs"]["content"]] for c in (choice, plain["choices"][0])]
    assert tokens[0] == tokens[1]
    chunks, usage = streamed(urls[name], {**REQUEST, "logprobs": True})
    assert joined(chunks, "reasoning_content") == thought
    assert joined(chunks, "content") == answer
    assert usage == plain["usage"]
    assert [t["token"] for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]] == (
        tokens[1]
    )
    for c in chunks[1:]:  # after the role: text of one kind or the other, or the finish
        assert (
            c["delta"].get("content")
            or c["delta"].get("reasoning_content")
            or (c["finish_reason"] or c["logprobs"])
        ), c


def test_the_openai_client_reads_reasoning_content(urls):
    client = openai.OpenAI(base_url=urls["qwen3"] + "/v1", api_key="x", max_retries=0)
    with client:
        out = client.chat.completions.create(
            **{k: v for k, v in REQUEST.items() if k != "structured_outputs"},
            extra_body={"structured_outputs": REQUEST["structured_outputs"]},
        )
    message = out.choices[0].message
    thought, answer = THINK.fullmatch(
        post(urls[""], REQUEST)["choices"][0]["message"]["content"]
    ).groups()
    assert (message.model_extra or {}).get("reasoning_content") == thought
    assert message.content == answer


def test_an_unconstrained_output_splits_by_the_parser(urls):
    """No grammar, no think block: deepseek_r1 calls the whole output reasoning (R1's
    template opened the block in the prompt), qwen3 the whole answer."""
    body = {"model": "tiny", "messages": REQUEST["messages"], "max_tokens": 8, "temperature": 0}
    text = post(urls[""], body)["choices"][0]["message"]["content"]
    assert "<think>" not in text and text
    r1 = post(urls["deepseek_r1"], body)["choices"][0]["message"]
    assert r1["reasoning_content"] == text and r1["content"] is None
    qwen = post(urls["qwen3"], body)["choices"][0]["message"]
    assert qwen["reasoning_content"] is None and qwen["content"] == text
    chunks, _ = streamed(urls["deepseek_r1"], body)
    assert joined(chunks, "reasoning_content") == text and not joined(chunks, "content")
