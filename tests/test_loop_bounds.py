"""The event loop does no work that grows with one request (issue 43).

Unit tests count work (ids decoded, characters searched, characters kept) rather
than time it: the incremental detokenizer stays O(1) a token while its text ends in
U+FFFD, the stop-string matcher and the tool-call parser look only at new text, the
tool-call parser bounds nesting, a long /detokenize decodes a bounded number of ids
a tokenizer call. Against a live `subway serve`: huge /tokenize and /detokenize
bodies and echoed prompt logprobs leave another client's stream flowing (a bounded
gap between its chunks), and the new caps (--max-logprobs,
--max-prompt-logprobs-tokens, --max-response-bytes) answer 400 with an OpenAI-style
error, the server serving on.

The names under test are imported inside each test, so that each fails on its own
against code without them.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import TINY_FLAGS, Server, until

MODEL = "tiny"
CONTEXT = 2048
MAX_GAP = 1.5  # seconds between two chunks of a stream while a big request is served


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


class CountingTokenizer:
    """The tokenizer, counting the calls to `decode` and the ids they take."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0
        self.calls = 0
        self.largest = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        self.calls += 1
        self.largest = max(self.largest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def replacement_ids(tokenizer) -> list[int]:
    """Ids that decode, alone, to U+FFFD: bytes of a character, never a whole one."""
    ids = [i for i in range(1024) if tokenizer.decode([i]) == "\ufffd"]
    assert len(ids) > 100
    return ids


# ---------------------------------------------------------------- detokenizer


def test_a_run_of_replacement_characters_costs_constant_decoding_a_token(tokenizer):
    """Before: while the text ended in U+FFFD every id was decoded again with all the
    held ones, so n such ids cost n^2 / 2 decoded ids."""
    from subway.frontend.detokenizer import IncrementalDetokenizer

    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    stray = next(i for i in replacement_ids(tokenizer) if tokenizer.decode([i] * 4) == "\ufffd" * 4)
    n = 4000
    ids = [stray] * n  # a byte that never forms a character, again and again
    pieces = []
    for k, i in enumerate(ids):
        pieces.append(detok.add(i))
        assert counting.decoded < 40 * (k + 1) + 64, f"quadratic after {k + 1} ids"
        assert counting.largest < 100, "a decode window that grows with the output"
    pieces.append(detok.flush())
    whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(pieces) == whole == "\ufffd" * n


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_text_with_stray_bytes_decodes_as_the_whole(tokenizer, data):
    """Releasing held ids early never changes the text: mixed stray bytes, characters
    split over ids, special tokens, in chunks of any size."""
    from subway.frontend.detokenizer import Detokenizer

    stray = replacement_ids(tokenizer)
    pool = stray + tokenizer.encode("é😀中 a\n👨‍👩‍👧", add_special_tokens=False) + [1, 2]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=120))
    step = data.draw(st.integers(1, 5))
    detok = Detokenizer(tokenizer)
    text = "".join(detok.add(ids[k : k + step]).text for k in range(0, len(ids), step))
    text += detok.finish().text
    assert text == tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def test_a_long_decode_takes_bounded_ids_a_call_and_gives_the_whole_text(tokenizer):
    from subway.frontend.detokenizer import decode_long

    rng = random.Random(0)
    stray = replacement_ids(tokenizer)
    text_ids = tokenizer.encode(
        "héllo 😀 中文 👨‍👩‍👧 <|im_start|> x" * 40, add_special_tokens=False
    )
    for trial in range(40):
        ids = [
            rng.choice(stray) if rng.random() < 0.2 else rng.choice(text_ids) for _ in range(300)
        ]
        for piece in (1, 3, 16):
            assert decode_long(tokenizer, ids, piece) == tokenizer.decode(ids), (trial, piece)
    counting = CountingTokenizer(tokenizer)
    ids = text_ids * 200
    assert decode_long(counting, ids, 1024) == tokenizer.decode(ids)
    assert counting.largest <= 1024 + 16 and counting.decoded < 1.2 * len(ids)


# ---------------------------------------------------------------- stop strings


def test_the_stop_matcher_keeps_and_searches_only_the_new_text():
    """Before: it kept the whole output and appended to it (a copy of all of it per
    piece); now it keeps at most the longest stop - 1 released characters."""
    from subway.frontend.detokenizer import StopStringMatcher

    stops = ["never appears", "xyz"]
    m = StopStringMatcher(stops)
    total = 0
    piece = "abcdefgxy "
    for _ in range(20_000):
        total += len(m.feed(piece))
        assert len(m.text) <= max(map(len, stops)) - 1 + len(piece)
    assert total == 20_000 * len(piece) - 0 and not m.stopped
    assert m.scanned < 4 * 20_000 * (len(piece) + len(stops[0]))
    assert m.feed("xyz!") == "" and m.stopped  # "xy" held at the end, then the stop


def test_the_stop_matcher_still_finds_a_stop_across_pieces():
    from subway.frontend.detokenizer import StopStringMatcher

    m = StopStringMatcher(["stop here"], include_stop=True)
    out = "".join(m.feed(c) for c in "a" * 5000 + "stop here and more")
    assert out == "a" * 5000 + "stop here" and m.stopped
    m = StopStringMatcher(["ab"])
    assert m.feed("xa", check=False) == "xa"  # within min_tokens: released, not matched
    assert m.feed("b tail") == "" and m.stopped  # a stop that starts inside it still ends it


# ---------------------------------------------------------------- tool-call parser


def test_hermes_parser_searches_each_character_a_bounded_number_of_times():
    from subway.frontend.tool_parsers import HermesParser

    p = HermesParser()
    n = 50_000
    out = []
    for _ in range(n):  # a model that writes only blank lines: held, never rescanned
        out += p.feed(" \n")
    assert out == [] and p.scanned < 3 * 2 * n + 64
    out = p.feed("<tool_call>")
    body = '{"name": "f", "arguments": {"x": "' + "y" * 10 + '"}}'
    for _ in range(n):  # a call's body that never ends
        out += p.feed("zz")
    assert p.scanned < 3 * 4 * n + 64 + len(body)
    out += p.finish()
    assert len(out) == 1 and isinstance(out[0], str) and out[0].startswith(" \n")


def test_hermes_parser_gives_the_same_calls_fed_whole_or_by_character():
    from subway.frontend.tool_parsers import CallPiece, HermesParser

    text = (
        'Sure.\n<tool_call>\n{"name": "get", "arguments": {"q": "a<tool_call>b"}}\n'
        '</tool_call>\n\n<tool_call>{"name": "put", "parameters": {"v": [1, {"w": 2}]}}'
        "</tool_call>\n<tool_call>not json</tool_call> tail <tool_ca"
    )

    def run(pieces):
        p = HermesParser()
        out = [x for piece in pieces for x in p.feed(piece)] + p.finish()
        content = "".join(x for x in out if isinstance(x, str))
        calls = [(x.name, x.arguments) for x in out if isinstance(x, CallPiece)]
        return content, calls

    whole = run([text])
    assert whole == run(list(text))
    assert whole[1] == [("get", '{"q": "a<tool_call>b"}'), ("put", '{"v": [1, {"w": 2}]}')]
    assert whole[0] == "Sure.\n\n<tool_call>not json</tool_call> tail <tool_ca"


@pytest.mark.parametrize("kind", ["hermes", "llama3_json"])
def test_deep_nesting_is_content_not_a_recursion_error(kind):
    """10^5 '[' in a call: before, json.loads raised RecursionError out of the parser (a
    500, or a stream cut); now a call nested past MAX_JSON_DEPTH is no call."""
    from subway.frontend.tool_formats import Llama3JsonParser
    from subway.frontend.tool_parsers import HermesParser

    deep = "[" * 100_000 + "]" * 100_000
    if kind == "hermes":
        p = HermesParser()
        text = '<tool_call>{"name": "f", "arguments": {"a": ' + deep + "}}</tool_call>"
    else:
        p = Llama3JsonParser()
        text = '{"name": "f", "parameters": {"a": ' + deep + "}}"
    out = p.feed(text[: len(text) // 2]) + p.feed(text[len(text) // 2 :]) + p.finish()
    assert p.calls == 0 and "".join(x for x in out if isinstance(x, str)) == text
    from subway.frontend.tool_parsers import MAX_JSON_DEPTH

    ok = "[" * (MAX_JSON_DEPTH - 4) + "]" * (MAX_JSON_DEPTH - 4)
    p = Llama3JsonParser()
    out = p.feed('{"name": "f", "parameters": {"a": ' + ok + "}}") + p.finish()
    assert p.calls == 1 and out[0].name == "f"


def test_tool_call_arguments_nested_too_deep_in_a_request_are_text():
    from subway.frontend.tools import _arguments

    deep = "[" * 100_000 + "]" * 100_000
    assert _arguments(deep) == deep
    assert _arguments('{"a": [1]}') == {"a": [1]}


# ---------------------------------------------------------------- rendering


def test_rendered_fields_are_the_json_of_the_fields_and_bounded():
    from subway.frontend import responses
    from subway.frontend.responses import TooLarge, render_fields

    fields = {"count": 3, "tokens": list(range(200_000)), "s": 'é"\\\n' * 50_000, "x": None}
    body = render_fields(fields)
    assert json.loads(body) == fields
    assert body == json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    assert responses.RENDER_PIECE < 200_000  # rendered in pieces
    with pytest.raises(TooLarge):
        render_fields(fields, max_bytes=100_000)


def test_a_whole_answer_renders_as_its_model_does():
    from subway.frontend.responses import (
        AssistantMessage,
        ChatChoice,
        ChatCompletionResponse,
        Usage,
    )
    from subway.frontend.views import render_json

    for n in (1, 3):
        body = ChatCompletionResponse(
            id="x",
            model='m"choices":[]',
            choices=[
                ChatChoice(index=i, message=AssistantMessage(content=f"c{i}")) for i in range(n)
            ],
            usage=Usage(prompt_tokens=1),
        )
        assert render_json(body) == body.model_dump_json().encode()


class ThreadsOf:
    """The tokenizer, noting which thread asks for each decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.threads: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.threads.append(threading.get_ident())
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class Events:
    """A finished ChoiceGroup: its events, then nothing."""

    max_bytes = 0

    def __init__(self, events) -> None:
        self._events = events

    async def events(self):
        for ev in self._events:
            yield ev

    def close(self) -> None:
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_echoed_prompt_logprobs_are_rendered_off_the_event_loop(tokenizer, stream):
    """Before: each of 2000 echoed positions decoded its token and 20 alternatives on the
    event loop's thread (42,000 decodes there for one choice); now the loop's thread
    decodes no more for a long prompt than for none."""
    from subway.frontend.choices import ChoiceEvent
    from subway.frontend.inputs import Job, Prompt
    from subway.frontend.logprobs import TokenLogprob
    from subway.frontend.protocol import CompletionRequest
    from subway.frontend.views import CompletionView

    ids = list(range(1000, 3000))
    prompt_lps = [TokenLogprob(ids[0], None, None)] + [
        TokenLogprob(i, -1.0, [(i + 7 * j + 1, -2.0 - j) for j in range(20)]) for i in ids[1:]
    ]
    event = ChoiceEvent(0, " x", [5], [TokenLogprob(5, -0.5, [(6, -1.0)])], "length", prompt_lps)
    body = {"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1, "stream": stream}
    counting = ThreadsOf(tokenizer)
    view = CompletionView(
        CompletionRequest.model_validate(body), Job([Prompt(ids)], []), "cmpl-1", MODEL, counting
    )

    async def run():
        if stream:
            answer = [chunk async for chunk in view.chunks(Events([event]))]
        else:
            answer = [await view.whole(Events([event]))]
        return answer, threading.get_ident()

    answer, loop_thread = asyncio.run(run())
    logprobs = answer[0].choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and len(logprobs.top_logprobs[1]) >= 20
    assert answer[0].choices[0].text == tokenizer.decode(ids) + " x"
    on_loop = sum(t == loop_thread for t in counting.threads)
    assert len(counting.threads) > len(ids)  # the work was done (each distinct id once) ...
    assert on_loop < 10, f"{on_loop} decodes on the event loop's thread"  # ... elsewhere


# ---------------------------------------------------------------- a live server


STREAM = """
import sys, time, httpx
body = {"model": sys.argv[2], "prompt": "one two three", "max_tokens": int(sys.argv[3]),
        "stream": True, "ignore_eos": True, "temperature": 0}
while True:  # one stream after another, until stopped
    with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                print(time.monotonic(), flush=True)
"""


class Timeline:
    """A child process that prints the time of each chunk of a stream it reads: its own
    clock readings, which this process's threads cannot delay. `largest_gap` is the
    longest wait between two of them."""

    def __init__(self, script: str, *args: str) -> None:
        self.times: list[float] = []
        self.flowing = threading.Event()
        cmd = [sys.executable, "-c", script, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.flowing.wait(60), "the child saw nothing come"

    @classmethod
    def stream(cls, url: str) -> Timeline:
        """A long streamed completion: the time of each chunk."""
        return cls(STREAM, url, MODEL, str(CONTEXT - 16))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.append(float(line))
            if len(self.times) == 5:
                self.flowing.set()

    def largest_gap(self, since: float, until: float) -> float:
        """The longest wait between `since` and `until` (then the child stops)."""
        self.proc.terminate()
        self.proc.wait(30)
        self.reader.join(30)
        before = [t for t in self.times if t < since]
        stamps = before[-1:] + [t for t in self.times if since <= t <= until] + [until]
        return max(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def is_error(r: httpx.Response, status: int = 400) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    keys = set(err) == {"message", "type", "param", "code"}
    return r.status_code == status and keys and err["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def server(servers, tiny_models):
    # TINY_FLAGS: a context of CONTEXT, and a long --template-timeout (tokenizing the big
    # prompts on a loaded machine is slow).
    return servers.get(tiny_models["llama"], *TINY_FLAGS)


def _post_json(url: str, body: dict):
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    return lambda: httpx.post(url, content=content, headers=headers, timeout=300)


def test_a_huge_detokenize_body_leaves_a_stream_flowing(server, tokenizer):
    """Before: /detokenize parsed its 8 MiB body, checked its 2.8M ids and decoded them
    in one tokenizer call, all on the event loop: every stream stopped for seconds."""
    one = tokenizer.encode("a", add_special_tokens=False)[0]
    ids = [one] * ((8 << 20) // (len(str(one)) + 1) - 16)  # 8 MiB of "64,64,..."
    detokenize = _post_json(server.url + "/detokenize", {"model": MODEL, "tokens": ids})
    stream = Timeline.stream(server.url)
    since = time.monotonic()
    r = detokenize()
    gap = stream.largest_gap(since, time.monotonic())
    assert r.status_code == 200, r.text[:300]
    assert r.json()["prompt"] == "a" * len(ids)
    assert gap < MAX_GAP, f"a stream waited {gap:.2f} s for a chunk"
    assert server.proc.poll() is None and server.healthy()


def test_a_huge_tokenize_answer_leaves_a_stream_flowing(server):
    """Before: /tokenize made its token strings and rendered its answer (here 2M ids and
    as many strings) on the event loop."""
    prompt = " ".join(str(k % 10) for k in range(1_000_000))  # a token a character
    body = {"model": MODEL, "prompt": prompt, "return_token_strs": True}
    tokenize = _post_json(server.url + "/tokenize", body)
    stream = Timeline.stream(server.url)
    since = time.monotonic()
    r = tokenize()
    gap = stream.largest_gap(since, time.monotonic())
    assert r.status_code == 200, r.text[:300]
    answer = r.json()
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"]) >= 1_999_999
    assert answer["token_strs"][:3] == ["0", "Ġ", "1"]
    assert gap < MAX_GAP, f"a stream waited {gap:.2f} s for a chunk"
    assert server.proc.poll() is None and server.healthy()


def test_more_top_logprobs_than_vllm_allows_is_a_400(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 21}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert is_error(r), r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "top_logprobs": 20},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"]) == 2


@pytest.fixture(scope="module")
def capped(tiny_models):
    s = Server(tiny_models["llama"], "--served-model-name", MODEL,
               "--max-model-len", str(CONTEXT), "--max-logprobs", "5",
               "--max-prompt-logprobs-tokens", "32",
               "--max-response-bytes", "8000")  # fmt: skip
    yield s
    s.stop()


def test_caps_are_400s_and_the_server_serves_on(capped):
    url = capped.url

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    r = post("/v1/chat/completions", {**chat, "top_logprobs": 6})
    assert is_error(r) and r.json()["error"]["param"] == "top_logprobs", r.text
    assert post("/v1/chat/completions", {**chat, "top_logprobs": 5}).status_code == 200
    r = post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 6})
    assert is_error(r) and r.json()["error"]["param"] == "logprobs", r.text

    long_prompt = list(range(1000, 1040))  # 40 prompt tokens, past the 32 cap
    echo = {"max_tokens": 1, "echo": True, "logprobs": 2}
    r = post("/v1/completions", {**echo, "prompt": long_prompt})
    assert is_error(r) and r.json()["error"]["param"] == "echo", r.text
    r = post("/v1/completions", {**echo, "prompt": long_prompt[:30]})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 31

    # An answer past 8,000 bytes: 400 once it passes, its choices aborted; streamed, served.
    big = {"prompt": "x", "max_tokens": 25, "n": 2, "logprobs": 5, "ignore_eos": True}
    r = post("/v1/completions", {**big, "max_tokens": CONTEXT - 8})
    assert is_error(r) and "--max-response-bytes" in r.json()["error"]["message"], r.text
    # Its choices were aborted: nothing runs on (2 x 2040 tokens would take a while).
    until(lambda: capped.metrics()["subway:num_requests_running"] == 0, within=10)
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, **big,
                      "stream": True}, timeout=120) as s:  # fmt: skip
        assert s.status_code == 200
        assert sum(len(line) for line in s.iter_lines()) > 8_000
    r = post("/detokenize", {"tokens": [1000] * 20_000})
    assert is_error(r) and "--max-response-bytes" in r.json()["error"]["message"], r.text
    r = post("/tokenize", {"prompt": "hello world " * 3_000})
    assert is_error(r), r.text[:300]

    assert capped.proc.poll() is None and capped.healthy()
    assert post("/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
