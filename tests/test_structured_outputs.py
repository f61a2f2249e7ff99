"""Structured outputs and the rest of the sampling surface vLLM users pass, end to end.

One live `subway serve` of the default model, driven by the official `openai`
client (and `subway.client` where token ids are needed): JSON schemas,
`json_object`, regexes, choices and grammars hold on chat (`response_format`,
`structured_outputs`) and completions (`structured_outputs`, `guided_*`),
streamed or not, greedy or sampled; the same prompt without the constraint
gives output that does not hold, so the constraint is what makes it hold.
Bad constraints are 400s that never reach the engine, and so is one that
compiles slower than `--grammar-timeout`. `logit_bias`, `min_tokens`,
`include_stop_str_in_output`, `skip_special_tokens` and `best_of` each have a
case that the code before them failed. Requests are few and short.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import jsonschema
import openai
import pytest

from subway.client import AsyncClient, Client, RequestError
from subway.frontend.errors import APIError
from subway.frontend.grammar import choice_grammar, request_grammar
from subway.frontend.protocol import ChatCompletionRequest, CompletionRequest
from subway.ipc.messages import Grammar

from reference import compare, hf_greedy
from serving import DEFAULT_FLAGS, Server

MODEL = "m"

# Each schema with a request that the model answers, unconstrained, with text that
# does not validate (prose, markdown fences, other keys).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "y": {"type": "number", "minimum": -10, "maximum": 10},
        "label": {"type": ["string", "null"], "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["x", "y", "tags"],
    "additionalProperties": False,
}
SCHEMAS = [
    (PERSON, "Describe a person with a name, an age and a role."),
    (ORDER, "Write an example shop order with an id, a list of items and whether it is paid."),
    (POINT, "Give me a point on a plane with a label."),
]
MAX_TOKENS = 90  # every schema's answer fits well within it


@pytest.fixture(scope="module")
def server(servers, default_model):
    return servers.get(default_model, *DEFAULT_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


def zmq_address(server: Server) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'subway-{server.run_id}')}/client.sock"


# ---------------------------------------------------------------- helpers


def answers(
    client: openai.OpenAI, content: str, stream: bool = False, **kw
) -> list[tuple[str, str]]:
    """A chat's choices as (content, finish_reason), whole or joined from the stream."""
    kw.setdefault("model", MODEL)
    messages = [{"role": "user", "content": content}]
    if not stream:
        out = client.chat.completions.create(messages=messages, **kw)
        return [(c.message.content, c.finish_reason) for c in out.choices]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [(texts[i], finish[i]) for i in sorted(texts)]


def chat(client: openai.OpenAI, content: str, stream: bool = False, **kw) -> list[str]:
    """The chat's choices' contents."""
    return [text for text, _ in answers(client, content, stream, **kw)]


def complete(client: openai.OpenAI, prompt, stream: bool = False, **kw) -> list[str]:
    kw.setdefault("model", MODEL)
    if not stream:
        return [c.text for c in client.completions.create(prompt=prompt, **kw).choices]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompt, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)]


def valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def completion_prompt(tok, content: str) -> str:
    """The chat template as a completion prompt: the model answers as in a chat."""
    messages = [{"role": "user", "content": content}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run_all(calls: list) -> list:
    """Callables run at once (the engine batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def is_error(r: httpx.Response, status: int = 400) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return r.status_code == status and err["code"] == status and bool(err["message"])


# ---------------------------------------------------------------- the request's constraint


def test_each_field_gives_its_grammar():
    def grammar(cls=CompletionRequest, **kw) -> Grammar | None:
        base = {"prompt": "x"} if cls is CompletionRequest else {"messages": [{"role": "user"}]}
        return request_grammar(cls.model_validate(base | kw))

    schema_text = json.dumps(PERSON)
    assert grammar() is None
    assert grammar(ChatCompletionRequest, response_format={"type": "text"}) is None
    assert grammar(response_format={"type": "json_object"}) == Grammar("json_object")
    got = grammar(ChatCompletionRequest, response_format=schema_format(PERSON))
    assert got.kind == "json_schema" and json.loads(got.spec) == PERSON
    for field in ({"structured_outputs": {"json": PERSON}}, {"guided_json": schema_text}):
        got = grammar(**field)
        assert got.kind == "json_schema" and json.loads(got.spec) == PERSON
    assert grammar(structured_outputs={"regex": "a+"}) == Grammar("regex", "a+")
    assert grammar(guided_regex="a+") == Grammar("regex", "a+")
    assert grammar(structured_outputs={"grammar": 'root ::= "x"'}) == Grammar(
        "ebnf", 'root ::= "x"'
    )
    assert grammar(structured_outputs={"json_object": True}) == Grammar("json_object")
    assert grammar(guided_choice=["a", "b"]).kind == "ebnf"
    bad = [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"structured_outputs": {"json": "7"}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
    ]
    for body, param in bad:
        with pytest.raises(APIError) as e:
            grammar(**body)
        assert e.value.status == 400 and e.value.param == param, body


def test_a_choice_grammar_matches_exactly_its_choices(tok):
    import xgrammar as xgr

    choices = ["yes", "no way", 'say "hi"', "back\\slash", "two\nlines", "été 🚇", "ye"]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(choice_grammar(choices))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()

    assert all(accepts(c) for c in choices)
    for other in ["y", "yes!", "no", 'say "hi', "back\\\\slash", "two lines", "été", ""]:
        assert not accepts(other), other


# ---------------------------------------------------------------- constraints hold


def test_json_schemas_hold_on_chat_and_completions_streamed_or_not(client, tok):
    """Every answer validates, greedy or sampled (two seeds), whichever field and
    endpoint asked, streamed or not; without the schema, none does."""
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    sampled = dict(temperature=0.8, max_tokens=MAX_TOKENS, n=2)

    def ways(schema: dict, ask: str) -> dict:
        rf, so = schema_format(schema), {"structured_outputs": {"json": schema}}
        prompt = completion_prompt(tok, ask)
        return {
            "chat, response_format": partial(chat, client, ask, response_format=rf),
            "chat, structured_outputs, streamed": partial(chat, client, ask, True, extra_body=so),
            "completion, streamed": partial(complete, client, prompt, True, extra_body=so),
            "completion": partial(complete, client, prompt, extra_body=so),
        }

    # Each schema greedy one way and sampled another: every way is used, greedy and sampled.
    plan = [(0, 2), (1, 0), (3, 1)]
    calls, checks = [], []
    for k, ((schema, ask), (g, s)) in enumerate(zip(SCHEMAS, plan, strict=True)):
        named = list(ways(schema, ask).items())
        calls += [
            partial(named[g][1], **greedy),
            partial(named[s][1], seed=k, **sampled),
            partial(chat, client, ask, temperature=0, max_tokens=30),
        ]
        checks += [(schema, named[g][0]), (schema, named[s][0]), (schema, None)]
    for (schema, way), texts in zip(checks, run_all(calls), strict=True):
        assert len(texts) in (1, 2)
        for text in texts:
            assert valid(schema, text) == (way is not None), (way, schema, text)


def test_json_object_regex_choice_and_grammar_hold(client, tok):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    an_object = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema('{"type": "object"}')
    ask_json = "Give a JSON object with the names of three colours."
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    colours = ["red", "green", "blue"]
    odd = ['a "quoted" word', "back\\slash", "two\nlines"]
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    prompt = completion_prompt(tok, "What is the phone number of the office?")
    json_object = {"type": "json_object"}
    calls = [
        lambda: answers(client, ask_json, response_format=json_object, temperature=0,
                        max_tokens=60),
        lambda: answers(client, ask_json, True, response_format=json_object, n=2,
                        temperature=0.8, seed=5, max_tokens=60),
        lambda: complete(client, prompt, extra_body={"structured_outputs": {"regex": phone}},
                         temperature=0, max_tokens=30),
        lambda: complete(client, prompt, True, extra_body={"guided_regex": phone}, n=2,
                         temperature=0.8, seed=6, max_tokens=30),
        lambda: chat(client, "Which colour is the sky?", True,
                     extra_body={"structured_outputs": {"choice": colours}}, temperature=0,
                     max_tokens=10),
        lambda: complete(client, "Pick one:", extra_body={"guided_choice": odd}, n=3,
                         temperature=0.8, seed=7, max_tokens=20),
        lambda: chat(client, "How many legs has a spider?",
                     extra_body={"structured_outputs": {"grammar": ebnf}}, temperature=0,
                     max_tokens=20),
        # The same prompts, free: not what the constraints make of them.
        lambda: chat(client, ask_json, temperature=0, max_tokens=20),
        lambda: complete(client, prompt, temperature=0, max_tokens=20),
        lambda: chat(client, "How many legs has a spider?", temperature=0, max_tokens=20),
    ]  # fmt: skip
    objs, objs2, ph, ph2, colour, picks, answer, *free = run_all(calls)
    free_object, free_phone, free_answer = (texts[0] for texts in free)
    # An object, whole; or, where sampling ran into max_tokens, the start of one.
    [(text, finish)] = objs
    assert finish == "stop" and is_object(text), text
    for text, finish in objs2:
        if finish == "stop":
            assert is_object(text), text
        else:
            assert finish == "length" and xgr.GrammarMatcher(an_object).accept_string(text)
    assert all(re.fullmatch(phone, t) for t in ph + ph2), (ph, ph2)
    assert colour[0] in colours and all(p in odd for p in picks), (colour, picks)
    assert re.fullmatch(r"The answer is [0-9]+\.", answer[0]), answer
    assert not is_object(free_object), free_object
    assert not re.fullmatch(phone, free_phone), free_phone
    assert not re.fullmatch(r"The answer is [0-9]+\.", free_answer), free_answer


def test_structured_outputs_through_the_native_endpoint(server):
    with Client(zmq_address(server)) as c:
        out = c.generate(
            "My favourite number is", max_tokens=12, temperature=0,
            structured_outputs={"regex": "[0-9]{2}!"},
        )  # fmt: skip
        assert re.fullmatch("[0-9]{2}!", out.text), out.text
        with pytest.raises(RequestError) as e:
            c.generate("x", max_tokens=4, structured_outputs={"regex": "(unclosed"})
        assert e.value.status == 400 and "regex" in str(e.value)


def test_free_requests_beside_constrained_ones_are_unchanged(server, default_model, tok):
    """Unconstrained greedy requests give the same tokens alone, amid constrained ones,
    and as transformers' greedy decoding: a grammar touches only its own rows."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    length = 12
    address = zmq_address(server)
    schemas = [SCHEMAS[0], SCHEMAS[2]]
    word = "[a-z ]{5,20}"

    async def free(c: AsyncClient) -> list[list[int]]:
        outs = await asyncio.gather(
            *[c.generate(p, max_tokens=length, temperature=0, ignore_eos=True) for p in prompts]
        )
        return [o.token_ids for o in outs]

    async def alone() -> list[list[int]]:
        async with AsyncClient(address) as c:
            return await free(c)

    async def crowded() -> tuple[list[list[int]], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        async with AsyncClient(address) as c:
            chats = [
                aclient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": ask}],
                    response_format=schema_format(schema), temperature=0, max_tokens=MAX_TOKENS,
                )
                for schema, ask in schemas
            ]  # fmt: skip
            words = [
                c.generate(p, max_tokens=length, temperature=0, structured_outputs={"regex": word})
                for p in prompts[:2]
            ]
            ours, *constrained = await asyncio.gather(free(c), *chats, *words)
        await aclient.close()
        texts = [r.choices[0].message.content for r in constrained[: len(chats)]]
        return ours, texts + [r.text for r in constrained[len(chats) :]]

    first = asyncio.run(alone())
    together, constrained = asyncio.run(crowded())
    assert together == first
    for (schema, _), text in zip(schemas, constrained, strict=False):
        assert valid(schema, text), text
    assert all(re.fullmatch(word, t) for t in constrained[len(schemas) :]), constrained
    for p, ours in zip(prompts, first, strict=True):
        ids = tok.encode(p, add_special_tokens=True)
        assert compare(ours, hf_greedy(default_model, ids, length)) == 0


# ---------------------------------------------------------------- bad constraints


BAD = [
    {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
    {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"structured_outputs": {"regex": "(unclosed"}},
    {"guided_regex": "a{3,1}"},
    {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
    {"guided_grammar": 'root ::= "a" |'},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"guided_regex": "a", "guided_choice": ["b"]},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"guided_json": "{this is not json"},
    {"guided_json": "[1, 2]"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "yaml"}},
    {"guided_choice": []},
]


def test_bad_constraints_are_400s_and_never_reach_the_engine(server):
    before = server.metrics()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for extra in BAD:
            for path, body in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                r = http.post(path, json={"model": MODEL, **body, **extra})
                assert is_error(r), (path, extra, r.status_code, r.text[:300])
                assert "/project/" not in r.text and ".cc:" not in r.text, r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    after = server.metrics()
    # Only the last request reached the engine; the bad grammars were counted as errors.
    assert after["subway:request_success_total"] - before["subway:request_success_total"] == 1
    errors = after["subway:grammar_compiles_total"] - before["subway:grammar_compiles_total"]
    assert errors >= 2 * 6  # the six that parse but do not compile, on both routes
    assert server.proc.poll() is None and "Traceback" not in server.read_output()


def test_compiles_are_counted_and_repeats_come_from_the_cache(server, client):
    schema = {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k"],
        "additionalProperties": False,
    }
    samples = "subway:grammar_compile_seconds_count"
    before = server.metrics()
    for _ in range(2):
        rf = schema_format(schema)
        [text] = chat(client, "Pick a digit k.", response_format=rf, temperature=0, max_tokens=24)
        assert valid(schema, text), text
    after = server.metrics()
    assert after[samples] - before[samples] == 2
    metric_lines = httpx.get(server.url + "/metrics").text.splitlines()
    by_result = {
        r: float(line.rsplit(" ", 1)[1])
        for line in metric_lines
        for r in ("cold", "cached", "error")
        if line.startswith("subway:grammar_compiles_total{") and f'result="{r}"' in line
    }
    assert by_result["cold"] >= 1 and by_result["cached"] >= 1


@pytest.mark.slow
def test_a_grammar_slower_than_the_limit_is_a_400(default_model):
    """A schema not compiled before takes milliseconds; the limit here is 1 ms."""
    s = Server(default_model, "--served-model-name", MODEL, "--grammar-timeout", "0.001")
    try:
        props = {f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}-[0-9]{1,5}"} for i in range(80)}
        slow = {"type": "object", "properties": props, "required": list(props)}
        with httpx.Client(base_url=s.url, timeout=60) as http:
            r = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "guided_json": slow},
            )
            assert is_error(r), r.text
            assert "compiling the grammar took longer" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200
        assert s.metrics()["subway:request_success_total"] == 1
    finally:
        s.stop()


# ---------------------------------------------------------------- the rest of the surface


def test_logit_bias_forces_and_forbids_tokens(server, client, tok):
    prompt = "The capital of France is"
    address = zmq_address(server)
    with Client(address) as c:
        free = c.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True).token_ids
        forced_id = tok.encode(" banana", add_special_tokens=False)[0]
        forced = c.generate(
            prompt, max_tokens=4, temperature=0, ignore_eos=True,
            logit_bias={str(forced_id): 100},
        ).token_ids  # fmt: skip
        banned = c.generate(
            prompt, max_tokens=4, temperature=0, ignore_eos=True,
            logit_bias={str(free[0]): -100},
        ).token_ids  # fmt: skip
    assert forced == [forced_id] * 4 and free[0] != forced_id
    assert banned[0] != free[0]
    text = complete(client, prompt, max_tokens=3, temperature=0.7, seed=1,
                    logit_bias={str(forced_id): 100})[0]  # fmt: skip
    assert text == tok.decode([forced_id] * 3)
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt, max_tokens=3, logit_bias={str(len(tok) + 5): 5})


def test_min_tokens_holds_back_eos_and_stop_strings(client, tok):
    messages = [{"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=60
    )
    n_short = out.usage.completion_tokens  # its EOS included
    assert out.choices[0].finish_reason == "stop" and n_short < 50
    out = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=n_short + 8,
        extra_body={"min_tokens": n_short + 8},
    )  # fmt: skip
    assert out.usage.completion_tokens == n_short + 8 and out.choices[0].finish_reason == "length"
    # A stop string in the first min_tokens tokens does not stop the request.
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"
    [full] = complete(client, prompt, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    stop = full.split(",")[0].strip()  # the first number the model writes
    assert stop and stop in full
    [cut] = complete(client, prompt, temperature=0, max_tokens=12, stop=[stop])
    [late] = complete(client, prompt, temperature=0, max_tokens=12, stop=[stop],
                      extra_body={"min_tokens": 6, "ignore_eos": True})  # fmt: skip
    assert cut == full[: full.find(stop)]
    assert late.startswith(full[: full.find(stop) + len(stop)]) and len(late) > len(cut + stop)
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt, max_tokens=4, extra_body={"min_tokens": 5})


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, stream):
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    [full] = complete(client, prompt, stream, temperature=0, max_tokens=10,
                      extra_body={"ignore_eos": True})  # fmt: skip
    stop = full.strip()[:2]
    kw = dict(temperature=0, max_tokens=10, stop=[stop])
    [cut] = complete(client, prompt, stream, **kw)
    [kept] = complete(client, prompt, stream, **kw, extra_body={"include_stop_str_in_output": True})
    assert cut == full[: full.find(stop)] and kept == cut + stop


def test_skip_special_tokens_false_shows_them(server, tok):
    """<|im_start|> forced with logit_bias: shown only when special tokens are not skipped."""
    special = tok.convert_tokens_to_ids("<|im_start|>")
    with Client(zmq_address(server)) as c:
        args = dict(max_tokens=3, temperature=0, logit_bias={str(special): 100})
        skipped = c.generate("Hello", **args)
        shown = c.generate("Hello", skip_special_tokens=False, **args)
    assert skipped.token_ids == shown.token_ids == [special] * 3
    assert skipped.text == "" and shown.text == "<|im_start|>" * 3


def test_response_format_text_changes_nothing(client):
    args = dict(temperature=0, max_tokens=8)
    assert chat(client, "Hi!", response_format={"type": "text"}, **args) == chat(
        client, "Hi!", **args
    )


def test_best_of_returns_the_n_runs_of_highest_cumulative_logprob(client):
    prompt = "My favourite fruit is"
    args = dict(prompt=prompt, max_tokens=5, temperature=1.0, seed=11, model=MODEL,
                extra_body={"ignore_eos": True})  # fmt: skip
    every = client.completions.create(n=4, logprobs=0, **args).choices  # the same four runs
    best = client.completions.create(n=2, best_of=4, logprobs=0, **args).choices
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.index for c in best] == [0, 1]
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    assert len({c.text for c in every}) > 2, "the runs differ"
    # Without logprobs asked, none are shown.
    plain = client.completions.create(n=1, best_of=4, **args).choices
    assert [c.text for c in plain] == [ranked[0].text] and plain[0].logprobs is None
    for bad in (dict(n=3, best_of=2), dict(best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**args | bad)


@pytest.mark.parametrize("compact", [False, True])
def test_json_whitespace_runs_are_bounded_by_default(tok, compact):
    """A JSON grammar takes pretty-printed JSON but no run of blanks longer than
    MAX_JSON_WHITESPACE (a small model would spend its max_tokens there); a compact one
    takes only json.dumps' separators."""
    import xgrammar as xgr

    from subway.ipc.grammar_build import MAX_JSON_WHITESPACE, compile_grammar
    from subway.ipc.messages import Grammar

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    compiled = compile_grammar(xgr.GrammarCompiler(info, max_threads=1),
                               Grammar("json_schema", schema, compact=compact))  # fmt: skip

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert takes('{"a": 1}')
    assert takes('{\n    "a": 1\n}') is not compact
    assert takes("{" + " " * MAX_JSON_WHITESPACE + '"a": 1}') is not compact
    assert not takes("{" + " " * (MAX_JSON_WHITESPACE + 1) + '"a": 1}')


def test_disable_any_whitespace_writes_json_as_json_dumps_does(client):
    """vLLM's `structured_outputs.disable_any_whitespace`: the only whitespace left is the
    single space after ", " and ": ", greedy and sampled, so the text is exactly what
    `json.dumps` writes of the value; and the field makes a compact grammar."""
    so = {"json": PERSON, "disable_any_whitespace": True}
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": so}
    )
    assert request_grammar(req).compact
    ask = "Describe a person."
    texts = chat(
        client, ask, temperature=0, max_tokens=MAX_TOKENS, extra_body={"structured_outputs": so}
    )
    texts += chat(client, ask, temperature=0.8, seed=3, n=2, max_tokens=MAX_TOKENS,
                  extra_body={"structured_outputs": so})  # fmt: skip
    for text in texts:
        assert valid(PERSON, text), text
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text
