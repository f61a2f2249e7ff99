"""Every HTTP endpoint of a live `subway serve`, fuzzed from its request model's schema.

The POST routes take their bodies from their pydantic request models (`frontend/protocol.py`,
`responses_protocol.py`, `messages_protocol.py`, `embeddings.py`):
each model's JSON schema (`model_json_schema()`) becomes a hypothesis strategy
(`Schema`), so a field added to a model is fuzzed without a change here; `HINTS`
steer a few fields toward values that get far (the served model, short prompts,
real grammars). Half of the bodies are schema-valid; in the other half any value
may be swapped for a nasty one (the wrong JSON type, numbers past every bound,
1e999, numeric-looking strings such as "²" or "０", lone surrogates, deep nesting),
required fields go missing and unknown unicode keys appear. Raw bodies that are
not JSON objects, the GET routes with random queries, wrong methods and unknown
paths make up the rest. The routes fuzzed must be exactly those that the server's
own OpenAPI document lists (`test_every_route_is_fuzzed`).

`IN_FLIGHT` requests are under way at once, so the engine batches them. Every
answer must be below 500 within `REQUEST_TIMEOUT`, carry no traceback, and be an
OpenAI-style error object when it is an error (a stream's error event too); a
choice constraint's answers must be among its choices. Afterwards the server
still answers `/health` and a completion, and its log holds no traceback. Short
generations (`HINTS`, `--default-max-tokens`) and `--request-timeout` bound the
valid requests' work: the default tier sends 300 requests, the slow tier 5,000.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subway.frontend.embeddings import EmbeddingRequest, ScoreRequest
from subway.frontend.messages_protocol import MessagesRequest, is_messages_path
from subway.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from subway.frontend.responses_protocol import ResponsesRequest
from subway.ipc.messages import SamplingParams
from subway.scheduler.checks import check_sampling

from serving import KV_BLOCKS, Server

MODEL = "tiny"
CONTEXT = 256  # room for a chat with tools (their schemas are in the prompt)
CHAT_MAX_TOKENS = 8  # a chat's max_tokens when it names none
VOCAB = 49152
IN_FLIGHT = 16  # requests under way at once
GENERATION_LIMIT = 20  # seconds a generation may run (--request-timeout; then "abort")
REQUEST_TIMEOUT = 60.0  # seconds; past it, a request counts as a hang
# Idle connections are dropped well before the server's keep-alive timeout (5 s), so that a
# request never goes out on a connection the server is closing at that moment (a reset).
KEEPALIVE = httpx.Limits(keepalive_expiry=1.0)
DEFAULT_REQUESTS = 300
SLOW_REQUESTS = 5000

POST_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    # Without --enable-lora every body is refused (400): the refusal is fuzzed.
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": MessagesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/score": ScoreRequest,
}
GET_ROUTES = ("/health", "/metrics", "/version", "/v1/models", "/openapi.json")
# Routes with a response id in their path (random ids: 404s, or a response made meanwhile),
# and the Messages API's other methods (405s in Anthropic's shape).
ID_ROUTES = (("GET", "/v1/responses/{rid}"), ("DELETE", "/v1/responses/{rid}"),
             ("GET", "/v1/responses/{rid}/input_items"), ("POST", "/v1/responses/{rid}/cancel"))  # fmt: skip
OTHER_ROUTES = tuple((m, "/v1/messages") for m in ("GET", "PUT", "PATCH", "DELETE"))
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")

# ---------------------------------------------------------------- values

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
# Strings that look like numbers to one parser and not to another (int() takes "０"
# and " 1", str.isdigit() takes "²", neither is a plain decimal integer).
NUMERIC_LOOKING = ["²", "¹", "０", "٣", "𝟙", " 1", "1 ", "1_0", "+1", "--1", "-0", "0x1",
                   "1e3", "1.0", "", "-", "1" * 5000, "9" * 40]  # fmt: skip
numeric_keys = st.sampled_from(NUMERIC_LOOKING) | st.text(
    st.characters(categories=["Nd", "No"]), min_size=1, max_size=3
)
dict_keys = st.text(max_size=8) | st.integers(-5, VOCAB + 5).map(str) | numeric_keys | numeric_keys
NASTY_SCALARS = [-1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324,
                 float("inf"), float("-inf"), "", "\x00", "\ud800", "a" * 5000,
                 *NUMERIC_LOOKING]  # fmt: skip


def nested(depth: int, leaf: object = 1) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


nasty = st.one_of(
    json_values,
    st.sampled_from(NASTY_SCALARS),
    st.integers(60, 400).map(nested),  # past the parser's depth limit, within json's
    st.dictionaries(dict_keys, json_values, max_size=4),
)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """The valid values five times in six, a nasty one the sixth."""
    return st.one_of(*[valid] * 5, nasty)


# Values the schema allows but rarely reaches by chance, so that valid bodies get far.
SMALL_SCHEMAS = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "maxLength": 3},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"enum": ["x", "y"]},
        {"type": "object"},
        {"type": "integer", "minimum": 1e999},
    ]
)
HINTS: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "other"]),
    "max_tokens": st.integers(1, 16),  # (the schema's own bounds come a third of the time)
    "max_completion_tokens": st.integers(1, 16),
    # Sequences of one request: mostly a few, now and then the server's cap (64) and past it.
    "n": st.integers(1, 3) | st.sampled_from([64, 65]),
    "best_of": st.integers(1, 4) | st.sampled_from([64, 65]),
    "prompt": st.text(min_size=1, max_size=30),
    "input": st.text(min_size=1, max_size=30),  # a response's, an embedding's
    "max_output_tokens": st.integers(1, 16),
    # A user's text: a conversation both chat and the Messages API take.
    "messages": st.lists(
        st.builds(lambda t: {"role": "user", "content": t}, st.text(min_size=1, max_size=20)),
        min_size=1,
        max_size=2,
    ),  # fmt: skip
    "text_1": st.text(min_size=1, max_size=20),
    "text_2": st.text(min_size=1, max_size=20),
    "stream_options": st.none(),  # (it needs "stream": true)
    "logit_bias": st.dictionaries(
        st.integers(-1, VOCAB).map(str) | numeric_keys, st.floats(-100, 100), min_size=1, max_size=3
    ),
    "type": st.just("text"),  # a content part's (the other `type`s are enums)
    "regex": st.sampled_from(["[a-z]{1,4}", "(yes|no)", "\\d+", "(", "a{99999}"]),
    "grammar": st.sampled_from(['root ::= "yes" | "no"', "root ::= ", 'root ::= root "a"']),
    "json": SMALL_SCHEMAS,
    "schema": SMALL_SCHEMAS,
    "parameters": SMALL_SCHEMAS,
    "guided_json": SMALL_SCHEMAS,
}
HINTS["choice"] = HINTS["guided_choice"] = st.sampled_from([["yes", "no"], ["a", "b c", "b"]])
HINTS["guided_regex"] = HINTS["regex"]
HINTS["guided_grammar"] = HINTS["grammar"]

# ---------------------------------------------------------------- schema -> strategy


@dataclass(frozen=True)
class Schema:
    """A model's JSON schema and whether its values may be swapped for nasty ones."""

    defs: dict
    junk: bool

    def of(self, node: dict, name: str = "") -> st.SearchStrategy:
        """Values of one schema node (`name`: the property that holds it, for HINTS)."""
        valid = self._plain(node)
        if name in HINTS and not {"enum", "const"} & node.keys():
            valid = st.one_of(HINTS[name], HINTS[name], valid)
        return mostly(valid) if self.junk else valid

    def _plain(self, node: dict) -> st.SearchStrategy:
        if "$ref" in node:
            return st.deferred(lambda: self._plain(self.defs[node["$ref"].split("/")[-1]]))
        if "anyOf" in node:
            return st.one_of([self._plain(n) for n in node["anyOf"]])
        if "const" in node:
            return st.just(node["const"])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        kind = node.get("type")
        if kind is None:
            return json_values
        return getattr(self, "_" + kind)(node)

    def _object(self, node: dict) -> st.SearchStrategy:
        props = node.get("properties")
        if not props:
            extra = node.get("additionalProperties", True)
            values = json_values if extra is True else self.of(extra)
            return st.dictionaries(dict_keys, values, min_size=1, max_size=4) | st.just({})
        required = set(node.get("required", ()))
        fields = {k: self.of(v, k) for k, v in props.items()}
        need = {k: s for k, s in fields.items() if k in required}
        rest = {k: s for k, s in fields.items() if k not in required}
        whole = st.fixed_dictionaries(need, optional=rest)
        if not rest:
            return whole
        # A few optional fields at a time as well: a body that sets many of them is
        # rarely valid as a whole (fields depend on each other), so it rarely gets far.
        few = st.lists(st.sampled_from(sorted(rest)), max_size=3, unique=True).flatmap(
            lambda names: st.fixed_dictionaries({**need, **{k: rest[k] for k in names}})
        )
        whole = whole | few
        if not self.junk:
            return whole
        # Now and then a required field goes missing, or unknown keys come along.
        missing = st.fixed_dictionaries({}, optional=fields)
        extra = st.builds(
            lambda d, e: {**e, **d}, whole, st.dictionaries(dict_keys, json_values, max_size=3)
        )
        return st.one_of(whole, whole, whole, missing, extra)

    def _array(self, node: dict) -> st.SearchStrategy:
        items = self._plain(node.get("items", {}))
        lo = node.get("minItems", 0)
        hi = min(node.get("maxItems", lo + 4), lo + 4)
        some = st.lists(items, min_size=max(lo, 1), max_size=max(hi, 1))
        return st.one_of(some, some, st.lists(items, min_size=lo, max_size=hi))

    def _string(self, node: dict) -> st.SearchStrategy:
        lo, hi = node.get("minLength", 0), node.get("maxLength", 24)
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True).map(lambda s: s[:hi])
        return st.text(min_size=lo, max_size=min(hi, max(lo, 24)))

    def _integer(self, node: dict) -> st.SearchStrategy:
        lo, hi = node.get("minimum"), node.get("maximum")
        if lo is None and hi is None:  # token ids and the like: mostly small
            return st.integers(0, 1000) | st.integers(-2, VOCAB + 2) | st.integers()
        lo = -(2**63) if lo is None else lo
        hi = 2**63 - 1 if hi is None else hi
        small = st.integers(lo, min(hi, lo + 8))
        return st.one_of(small, small, small, st.sampled_from([lo, hi]), st.integers(lo, hi))

    def _number(self, node: dict) -> st.SearchStrategy:
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        hi = node.get("maximum", node.get("exclusiveMaximum"))
        return st.floats(
            lo,
            hi,
            exclude_min="exclusiveMinimum" in node,
            exclude_max="exclusiveMaximum" in node,
            allow_nan=False,
            allow_infinity=False,
        )

    def _boolean(self, node: dict) -> st.SearchStrategy:
        return st.booleans()

    def _null(self, node: dict) -> st.SearchStrategy:
        return st.none()


def bodies(model: type, junk: bool) -> st.SearchStrategy:
    """Request bodies (as Python values) from a request model's JSON schema."""
    schema = model.model_json_schema()
    return Schema(schema.get("$defs", {}), junk)._object(schema)


def encode(body: object) -> bytes:
    """JSON text; infinities go out as 1e999 (which json.loads reads as inf), NaN as NaN."""
    return json.dumps(body, allow_nan=True).replace("Infinity", "1e999").encode()


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    content: bytes = b""

    def __repr__(self) -> str:
        return f"{self.method} {self.path} {self.content[:400]!r}"


RAW_BODIES = [
    b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe{}", b"\xef\xbb\xbf{}",
    b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"a": ' * 3000 + b"1" + b"}" * 3000,
    b'{"prompt": "\\ud800", "model": "tiny"}',
    b'{"messages": NaN}', b'{"tokens": [1, 2], "tokens": -Infinity}',
    b'{"prompt": "hi", "n": 1, "n": 999}',
]  # fmt: skip
post_paths = st.sampled_from(sorted(POST_MODELS))


def posts(junk: bool) -> st.SearchStrategy:
    """POSTs of a body from the route's model (each route's strategy built once)."""
    return st.one_of(
        [
            bodies(model, junk).map(lambda b, p=path: Call("POST", p, encode(b)))
            for path, model in sorted(POST_MODELS.items())
        ]
    )


valid_posts, junk_posts = posts(junk=False), posts(junk=True)
raw_posts = st.builds(
    lambda p, b: Call("POST", p, b),
    post_paths,
    st.sampled_from(RAW_BODIES) | st.binary(max_size=64),
)
any_json_posts = st.builds(lambda p, b: Call("POST", p, encode(b)), post_paths, nasty)
queries = st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=3).map(
    lambda q: "?" + urllib.parse.urlencode(q) if q else ""
)
gets = st.builds(lambda p, q: Call("GET", p + q), st.sampled_from(GET_ROUTES), queries)
by_id = st.builds(
    lambda route, rid: Call(route[0], route[1].replace("{rid}", urllib.parse.quote(rid, safe=""))),
    st.sampled_from(ID_ROUTES),
    st.text(min_size=1, max_size=12)
    | st.text("0123456789abcdef", max_size=32).map("resp_".__add__),
) | st.builds(lambda route: Call(*route), st.sampled_from(OTHER_ROUTES))
KNOWN = sorted([*POST_MODELS, *GET_ROUTES])
elsewhere = st.builds(
    lambda m, p: Call(m, p),
    st.sampled_from(METHODS),
    st.sampled_from(KNOWN)
    | st.text(min_size=1, max_size=12).map(lambda s: "/v1/" + urllib.parse.quote(s)),
)
calls = st.one_of(
    valid_posts, valid_posts, valid_posts, junk_posts, junk_posts, junk_posts,
    raw_posts, any_json_posts, gets, elsewhere, by_id,
)  # fmt: skip

# ---------------------------------------------------------------- checks


def check(call: Call, r: httpx.Response) -> None:
    """No 5xx, no traceback, errors in the API's own shape (OpenAI's; Anthropic's on the
    Messages API), streams ending as their API ends them, a choice constraint's answers
    among its choices."""
    assert r.status_code < 500, (call, r.status_code, r.text[:500])
    assert "Traceback" not in r.text, (call, r.text[:2000])
    if call.method == "HEAD" or r.status_code == 204:
        return
    path = call.path.split("?")[0]
    if r.status_code >= 400:
        body = r.json()
        if is_messages_path(path):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (
                call, r.text[:500])  # fmt: skip
            return
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, (call, r.text[:500])
        return
    ctype = r.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        check_stream(call, path, [line[6:] for line in r.text.splitlines()
                                  if line.startswith("data: ")])  # fmt: skip
    elif ctype.startswith("application/json"):
        body = r.json()
        allowed = choice_constraint(call)
        for c in body.get("choices", []) if allowed else []:
            text = c["text"] if "text" in c else c["message"]["content"]
            assert c["finish_reason"] != "stop" or text in allowed, (call, text)


def check_stream(call: Call, path: str, data: list[str]) -> None:
    """A stream's events: each API's last event, and no error event of a server fault."""
    assert data, (call, "an empty stream")
    if path == "/v1/messages":
        events = [json.loads(d) for d in data]
        assert events[-1]["type"] in ("message_stop", "error"), (call, data[-3:])
        faults = [e for e in events if e["type"] == "error" and e["error"]["type"] == "api_error"]
        assert not faults, (call, faults)
    elif path == "/v1/responses":
        events = [json.loads(d) for d in data]
        last = ("response.completed", "response.incomplete", "response.failed")
        assert events[-1]["type"] in last, (call, data[-3:])
        assert all(int(e["code"]) < 500 for e in events if e["type"] == "error"), (call, data)
    else:
        assert data[-1] == "[DONE]", (call, data[-3:])
        for line in data[:-1]:
            event = json.loads(line)
            if "error" in event:
                assert event["error"]["code"] < 500, (call, event)


def choice_constraint(call: Call) -> list[str] | None:
    """The only texts a generation may end with (finish_reason "stop"), where the request
    asks a choice of printable ASCII strings and nothing else ends or changes the text
    (echo, stop strings or ids, tools)."""
    if call.method != "POST" or not call.path.startswith("/v1/"):
        return None
    try:
        body = json.loads(call.content)
    except ValueError:
        return None
    if not isinstance(body, dict) or any(
        body.get(k) for k in ("echo", "stop", "stop_token_ids", "tools")
    ):
        return None
    so = body.get("structured_outputs")
    choices = body.get("guided_choice") or (so.get("choice") if isinstance(so, dict) else None)
    plain = isinstance(choices, list) and all(
        isinstance(c, str) and c.isascii() and c.isprintable() for c in choices
    )
    return choices if plain else None


class Sender:
    """Keeps up to `IN_FLIGHT` requests going (so that the engine batches them), from
    threads with a connection pool each; collects the failed checks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.local = threading.local()
        self.clients: list[httpx.Client] = []
        self.pool = ThreadPoolExecutor(IN_FLIGHT)
        self.slots = threading.BoundedSemaphore(IN_FLIGHT)
        self.lock = threading.Lock()
        self.sent = 0
        self.statuses: Counter[tuple[str, int]] = Counter()  # (route, status): answers
        self.failures: list[str] = []

    def _client(self) -> httpx.Client:
        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = httpx.Client(
                base_url=self.url, timeout=REQUEST_TIMEOUT, limits=KEEPALIVE
            )
            with self.lock:
                self.clients.append(c)
        return c

    def _one(self, call: Call) -> None:
        headers = {"content-type": "application/json"} if call.content else {}
        route = call.path.split("?")[0]
        route = route if route in KNOWN else "(unknown)"
        try:
            r = self._client().request(
                call.method, call.path, content=call.content, headers=headers
            )
            check(call, r)
        except (AssertionError, httpx.HTTPError, ValueError) as e:  # ValueError: bad JSON
            with self.lock:
                self.failures.append(f"{call!r}\n  -> {type(e).__name__}: {str(e)[:1500]}")
        else:
            with self.lock:
                self.statuses[route, r.status_code] += 1
        finally:
            with self.lock:
                self.sent += 1
            self.slots.release()

    def submit(self, call: Call) -> None:
        """Send `call` on a free thread (waiting for one)."""
        self.slots.acquire()
        self.pool.submit(self._one, call)

    def drain(self) -> None:
        """Wait until every request sent has been answered and checked."""
        for _ in range(IN_FLIGHT):
            self.slots.acquire()
        for _ in range(IN_FLIGHT):
            self.slots.release()

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.clients:
            c.close()


@pytest.fixture(scope="module")
def server(tiny_models) -> Iterator[Server]:
    s = Server(
        tiny_models["qwen3"],
        "--served-model-name", MODEL,
        "--max-model-len", str(CONTEXT),
        "--default-max-tokens", str(CHAT_MAX_TOKENS),
        "--request-timeout", str(GENERATION_LIMIT),
        "--max-num-seqs", "16",
        *KV_BLOCKS,
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sender(server) -> Iterator[Sender]:
    s = Sender(server.url)
    yield s
    s.close()


def fuzz(sender: Sender, requests: int) -> Callable[[], None]:
    """A hypothesis test that sends `requests` generated requests. They overlap, so a
    failure is reported with its request (the failing bodies, all of them) rather than
    shrunk by hypothesis."""

    @settings(
        max_examples=requests,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls)
    def run(call: Call) -> None:
        sender.submit(call)

    return run


def run_fuzz(sender: Sender, server: Server, requests: int) -> None:
    before, t0 = sender.sent, time.monotonic()
    fuzz(sender, requests)()
    sender.drain()
    sent, took = sender.sent - before, time.monotonic() - t0
    print(f"\nfuzzed {sent} requests in {took:.1f} s ({sent / took:.0f}/s)")
    print(sorted(sender.statuses.items()))
    failures = sender.failures
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:10])
    assert sent >= requests
    assert server.proc.poll() is None
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_every_route_is_fuzzed(server):
    """The server's OpenAPI document lists exactly the routes fuzzed here, with their methods."""
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    listed = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    fuzzed = {("POST", p) for p in POST_MODELS} | {("GET", p) for p in GET_ROUTES}
    fuzzed |= set(ID_ROUTES) | set(OTHER_ROUTES)
    assert listed == fuzzed - {("GET", "/openapi.json")}


# "²", "¹", "--1" and 5,000 digits were a 500 with a traceback in the log (str.isdigit()
# passed them, int() did not); int() took the others ("０" as token 0).
BAD_KEYS = ["²", "¹", "--1", "1" * 5000, "０", "٣", " 1", "1_0", "+1", "0x1", "", "-"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: ascii(k)[:16])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_keys_are_plain_integers(server, route, key):
    """A logit_bias key that is not a decimal integer in ASCII digits is a 400 naming
    logit_bias; plain ones (a sign, leading zeros) still serve."""
    req: dict = {"model": MODEL, "max_tokens": 1, "logit_bias": {key: 1}}
    if route == "/v1/completions":
        req["prompt"] = "hi"
    else:
        req["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + route, json=req, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias", r.text
    ok = {**req, "logit_bias": {"-0": 0, "15": -100, "0007": 1.5}}
    assert httpx.post(server.url + route, json=ok, timeout=30).status_code == 200


# Each was a 200 whose text broke its grammar: the sampler divides float32 logits by them,
# 1e308 and 1e39 are inf in float32 and 5e-324 and 1e-46 are 0, so the logits turned NaN.
PAST_FLOAT32 = [
    ("temperature", 1e308),
    ("temperature", 1e39),
    ("repetition_penalty", 5e-324),
    ("repetition_penalty", 1e-46),
]


@pytest.mark.parametrize(("field", "value"), PAST_FLOAT32)
def test_sampling_values_past_float32_are_refused(server, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    r = httpx.post(server.url + "/v1/completions", json={**body, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1e4), ("repetition_penalty", 1e-4), ("repetition_penalty", 1e4)],
)
def test_sampling_values_at_the_bounds_keep_the_grammar(server, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 4, "guided_choice": ["yes", "no"]}
    r = httpx.post(server.url + "/v1/completions", json={**body, field: value}, timeout=60)
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}, r.text


def test_the_scheduler_refuses_them_too():
    """What reaches the scheduler by another way than the HTTP models is checked again."""
    for field, value in PAST_FLOAT32:
        assert check_sampling(SamplingParams(**{field: value}), VOCAB) is not None, field
    assert check_sampling(SamplingParams(temperature=1e4, repetition_penalty=1e-4), VOCAB) is None


def test_fuzz_every_endpoint(sender, server):
    run_fuzz(sender, server, DEFAULT_REQUESTS)


@pytest.mark.slow
def test_fuzz_every_endpoint_5000(sender, server):
    run_fuzz(sender, server, SLOW_REQUESTS)


def test_still_serving_after_the_fuzz(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    log = server.read_output()
    assert "Traceback" not in log, log[-3000:]
