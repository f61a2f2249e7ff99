"""Random JSON bodies (hypothesis) against a live server: never a 5xx, never a hang.

Bodies mix the real fields with random values of every JSON type, so that many
are nearly valid; a short context (48 tokens) keeps the valid ones quick. Every
error is an OpenAI-style error object; every 200 is a well-formed answer.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import KV_BLOCKS, Server

MODEL = "tiny"
CONTEXT = 48
VOCAB = 49152

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """The valid values seven times in eight, anything else the eighth."""
    return st.one_of(*[valid] * 7, json_values)


token_ids = st.lists(st.integers(0, 1000), min_size=1, max_size=8) | st.lists(
    st.integers(-2, VOCAB + 2), max_size=8
)
text = st.text(max_size=30)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "user", "bot"]),
        "content": mostly(
            text
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "text", "image_url"]), "text": text}
                ),
                max_size=2,
            )
        ),
    }
)
# The valid values of each field (with a few out-of-range ones).
SAMPLING = {
    "model": st.sampled_from([MODEL] * 5 + ["other"]),
    "max_tokens": st.integers(1, 8) | st.integers(-2, 100),
    "n": st.integers(1, 3) | st.integers(-1, 200),
    "temperature": st.floats(0, 2) | st.floats(-1, 1e6),
    "top_p": st.floats(0.01, 1) | st.floats(-1, 2),
    "top_k": st.integers(-1, 60) | st.integers(-(2**40), 2**40),
    "min_p": st.floats(0, 1) | st.floats(-1, 2),
    "seed": st.integers(0, 2**63 - 1) | st.integers(-(2**70), 2**70),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2) | st.floats(-5, 5),
    "frequency_penalty": st.floats(-2, 2) | st.floats(-5, 5),
    "repetition_penalty": st.floats(0.01, 3) | st.floats(-1, 1e5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "skip_special_tokens": st.booleans(),
    "priority": st.integers(-5, 5) | st.integers(-(2**70), 2**70),
    "timeout": st.floats(0.05, 5) | st.floats(-1, 1e9),
}
COMPLETION = {
    "prompt": text
    | token_ids
    | st.lists(text, min_size=1, max_size=3)
    | st.lists(token_ids, max_size=3),
}
COMPLETION_OPTIONAL = {
    **SAMPLING,
    "echo": st.booleans(),
    "logprobs": st.integers(0, 5) | st.integers(-1, 30),
}
CHAT = {"messages": st.lists(message, min_size=1, max_size=3)}
CHAT_OPTIONAL = {
    **SAMPLING,
    "max_completion_tokens": st.integers(1, 8) | st.integers(-2, 100),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5) | st.integers(-1, 30),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
}
TOKENIZE = {
    "prompt": text,
    "messages": st.lists(message, min_size=1, max_size=2),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
}
JUNK_ONLY = {  # fields that take anything: random values, or left out
    "logit_bias": json_values,
    "user": json_values,
    "suffix": json_values,
    "chat_template_kwargs": json_values,
}


def body_for(required: dict, optional: dict, junk: bool) -> st.SearchStrategy:
    if not junk:
        return st.fixed_dictionaries(required, optional=optional)
    required = {k: mostly(v) for k, v in required.items()}
    optional = {**{k: mostly(v) for k, v in optional.items()}, **JUNK_ONLY}
    full = st.fixed_dictionaries(required, optional=optional)
    # Now and then a required field is missing.
    return full | st.fixed_dictionaries({}, optional={**required, **optional})


def routes(junk: bool) -> dict[str, st.SearchStrategy]:
    return {
        "/v1/completions": body_for(COMPLETION, COMPLETION_OPTIONAL, junk),
        "/v1/chat/completions": body_for(CHAT, CHAT_OPTIONAL, junk),
        "/tokenize": body_for({}, TOKENIZE, junk),
        "/detokenize": body_for({"tokens": token_ids}, {"model": SAMPLING["model"]}, junk),
    }


def requests_of(table: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.sampled_from(sorted(table)).flatmap(lambda r: st.tuples(st.just(r), table[r]))


requests = requests_of(routes(junk=True))  # nearly valid bodies
route_names = st.sampled_from(sorted(routes(junk=False)))
valid_requests = requests_of(
    {k: v for k, v in routes(junk=False).items() if k.startswith("/v1")}
)  # in-range bodies: most of them generate


@pytest.fixture(scope="module")
def server(tiny_models):
    s = Server(
        tiny_models["qwen3"],
        "--served-model-name", MODEL,
        "--max-model-len", str(CONTEXT),
        "--max-num-seqs", "16",
        *KV_BLOCKS,
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0)) as c:
        yield c


def _check(r: httpx.Response, body: bytes) -> None:
    assert r.status_code < 500, (r.status_code, body[:300], r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", (body[:300], r.text[-300:])
        for line in lines[:-1]:
            event = json.loads(line[6:])
            assert "error" not in event, (body[:300], event)
    else:
        r.json()


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests)
def test_random_bodies_never_5xx(http, request):
    route, body = request
    raw = json.dumps(body).encode()
    _check(http.post(route, content=raw, headers={"content-type": "application/json"}), raw)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=valid_requests)
def test_valid_bodies_answer_well(http, request):
    route, body = request
    raw = json.dumps(body).encode()
    _check(http.post(route, content=raw, headers={"content-type": "application/json"}), raw)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(route=route_names, body=json_values)
def test_random_json_of_any_shape(http, route, body):
    raw = json.dumps(body).encode()
    _check(http.post(route, content=raw, headers={"content-type": "application/json"}), raw)


def test_still_serving_after_the_fuzz(http, server):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
    assert "Traceback" not in server.read_output(), server.read_output()[-3000:]
