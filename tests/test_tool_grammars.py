"""Forced tool calls (tool_choice "required" or a named function) in each format's own
grammar (`frontend/tool_grammars.py`): the format's canonical calls are accepted and read
back by the same format's parser, text that is not calls of the tools is refused, and
outputs sampled at random under the grammar parse into calls that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.tool_formats import auto_parser
from subway.frontend.tool_grammars import forced_calls
from subway.ipc.grammar_build import compile_grammar

xgr = pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London"]},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
FUNCTIONS = [("get_weather", WEATHER), ("get_time", TIME)]
SCHEMAS = dict(FUNCTIONS)

# Two calls in each format: get_weather(city="Paris", days=3), get_time(zone="UTC").
CANONICAL = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
    "pythonic": '[get_weather(city="Paris", days=3), get_time(zone="UTC")]',
}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
# What each format's single call of get_time is, and texts its grammar must refuse.
SINGLE = {
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
    "</function>\n</tool_call>",
    "pythonic": '[get_time(zone="UTC")]',
}
FORMATS = list(CANONICAL)


@pytest.fixture(scope="module")
def compiler(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    return tok, xgr.GrammarCompiler(info), info.vocab_size


def accepts(compiler, grammar, text: str) -> bool:
    tok, comp, _ = compiler
    m = xgr.GrammarMatcher(compile_grammar(comp, grammar))
    return m.accept_string(text) and (m.is_terminated() or m.accept_token(tok.eos_token_id))


def parse(fmt: str, text: str, cuts: int = 1) -> tuple[str, list[tuple[str, dict]]]:
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in FUNCTIONS]
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    )
    parser = auto_parser(fmt, req.tools)
    step = max(1, len(text) // cuts)
    pieces = [p for i in range(0, len(text), step) for p in parser.feed(text[i : i + step])]
    pieces += parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if not isinstance(p, str)]
    return content, calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_formats_own_calls_are_taken_and_read_back(compiler, fmt):
    required = forced_calls(fmt, FUNCTIONS, at_most_one=False)
    assert accepts(compiler, required, CANONICAL[fmt])
    assert accepts(compiler, required, SINGLE[fmt])
    for cuts in (1, 3, len(CANONICAL[fmt])):
        assert parse(fmt, CANONICAL[fmt], cuts) == ("", CALLS)
    one = forced_calls(fmt, FUNCTIONS, at_most_one=True)
    assert accepts(compiler, one, SINGLE[fmt]) and not accepts(compiler, one, CANONICAL[fmt])
    named = forced_calls(fmt, [("get_time", TIME)], at_most_one=True)
    assert accepts(compiler, named, SINGLE[fmt])
    assert parse(fmt, SINGLE[fmt]) == ("", [CALLS[1]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_is_not_a_call_of_the_tools_is_refused(compiler, fmt):
    required = forced_calls(fmt, FUNCTIONS, at_most_one=False)
    single = SINGLE[fmt]
    assert not accepts(compiler, required, "Sure. " + single)  # text before the calls
    assert not accepts(compiler, required, "")  # no call at all
    assert not accepts(compiler, required, single.replace("get_time", "get_tim"))
    assert not accepts(compiler, required, single.replace("zone", "area"))  # a required key
    assert not accepts(compiler, required, single + " and more")  # text after
    named = forced_calls(fmt, [("get_weather", WEATHER)], at_most_one=True)
    assert not accepts(compiler, named, single)  # not the named function


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_random_outputs_under_the_grammar_are_valid_calls(compiler, fmt):
    """A random walk through the grammar (random logits, pushed towards closing text after
    a few tokens so that it ends): every output that ends is calls of the tools, each
    valid against its parameters' schema, and no content."""
    tok, comp, vocab = compiler
    closers = {tok.eos_token_id}
    for text in ('"', "}", "]", ")", "\n", "</tool_call>", ", ", '"}', "}}", ")]", "="):
        closers.update(tok.encode(text, add_special_tokens=False))
    push = torch.zeros(vocab)
    push[sorted(closers)] = 6.0
    ended = 0
    for at_most_one in (False, True):
        grammar = compile_grammar(comp, forced_calls(fmt, FUNCTIONS, at_most_one))
        for seed in range(4):
            gen = torch.Generator().manual_seed(seed)
            m = xgr.GrammarMatcher(grammar)
            mask = xgr.allocate_token_bitmask(1, vocab)
            out: list[int] = []
            for i in range(300):
                m.fill_next_token_bitmask(mask)
                logits = torch.randn(1, vocab, generator=gen) + (push if i > 10 else 0)
                xgr.apply_token_bitmask_inplace(logits, mask)
                t = int(torch.argmax(logits))
                if t == tok.eos_token_id or m.is_terminated():
                    break
                assert m.accept_token(t)
                out.append(t)
            else:
                continue  # cut: no claim on a half call
            ended += 1
            content, calls = parse(fmt, tok.decode(out))
            assert content == "" and calls and (len(calls) == 1 or not at_most_one)
            for name, args in calls:
                jsonschema.validate(args, SCHEMAS[name])
    assert ended >= 6
