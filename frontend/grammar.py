"""Structured outputs at the frontend: a request's output constraint as a `Grammar`, and
its check before the engine ever sees it.

`request_grammar` reads the constraint from whichever field gave it (OpenAI's
`response_format`; vLLM's `structured_outputs` and its older `guided_*`
spellings): one at most, across them all. A JSON schema travels as its JSON text,
a `choice` as an EBNF grammar that matches exactly one of the choices.

`GrammarCheck.check` compiles the grammar with xgrammar for the engine's
vocabulary: what does not compile (an invalid schema, regex or EBNF) is a 400
with xgrammar's message, so that no request reaches the engine with a grammar
its worker cannot compile; what does not compile within `--grammar-timeout` is
a 400 too. The compile runs in a worker process that the time limit kills
(`grammar_pool.py`); the frontend keeps only each grammar's verdict, by a
16-byte digest of its text (`VerdictCache`: `SEEN_GRAMMARS` of them, a few MB
at most whatever the grammars' size), so that a grammar that many requests
share costs its compile once. `GrammarChecker` compiles in-process, with
xgrammar's own cache (for tools and benchmarks; the server does not use it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from subway.frontend.errors import APIError
from subway.frontend.grammar_pool import (
    CompileTimeout,
    GrammarPool,
    PoolBusy,
    PoolError,
    WorkerDied,
)
from subway.frontend.protocol import ResponseFormat, SamplingRequest, StructuredOutputs
from subway.ipc.grammar_build import compile_grammar
from subway.ipc.messages import MAX_GRAMMAR_CHARS, Grammar

CACHE_BYTES = 64 << 20  # `GrammarChecker`'s xgrammar cache (xgrammar keeps it near this)
SEEN_GRAMMARS = 4096  # grammar verdicts remembered, by digest
COMPILE_THREADS = 2  # xgrammar's threads for one of `GrammarChecker`'s compiles
MAX_ERROR_CHARS = 500
DIGEST_BYTES = 16
INLINE_BYTES = 1 << 16  # grammars encoded and hashed on the event loop up to this size
_OK = ""  # the verdict of a grammar that compiled

# xgrammar's messages start with a time and a C++ source location: not for clients.
_LOCATION = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def request_grammar(req: SamplingRequest) -> Grammar | None:
    """The grammar the request's output must follow (None: free text).

    More than one constraint, across `response_format`, `structured_outputs`
    and `guided_*` (or two inside `structured_outputs`), is a 400."""
    found = request_constraint(req)
    return found[1] if found is not None else None


def request_constraint(req: SamplingRequest) -> tuple[str, Grammar] | None:
    """`request_grammar`'s grammar with the name of the field that gave it."""
    found: list[tuple[str, Grammar]] = []
    if req.response_format is not None:
        g = _from_response_format(req.response_format)
        if g is not None:
            found.append(("response_format", g))
    if req.structured_outputs is not None:
        found += _from_structured_outputs(req.structured_outputs, "structured_outputs")
    found += _constraints(
        "", req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar, None
    )
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(
            400, f"give one output constraint at most, not several ({names})", found[1][0]
        )
    if not found:
        return None
    param, grammar = found[0]
    if len(grammar.spec) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"the constraint is longer than {MAX_GRAMMAR_CHARS} characters", param)
    return param, grammar


def _from_response_format(rf: ResponseFormat) -> Grammar | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return Grammar("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(
            400, "a json_schema response_format needs json_schema.schema", "response_format"
        )
    return Grammar("json_schema", _schema_text(rf.json_schema.schema_, "response_format"))


def _from_structured_outputs(so: StructuredOutputs, prefix: str) -> list[tuple[str, Grammar]]:
    found = _constraints(prefix, so.json_, so.regex, so.choice, so.grammar, so.json_object)
    if so.disable_any_whitespace:
        found = [
            (name, msgspec.structs.replace(g, compact=True))
            if g.kind in ("json_schema", "json_object")
            else (name, g)
            for name, g in found
        ]
    return found


def _constraints(
    prefix: str,
    schema: dict | str | None,
    regex: str | None,
    choice: list[str] | None,
    ebnf: str | None,
    json_object: bool | None,
) -> list[tuple[str, Grammar]]:
    """Each constraint given, with the name of its field (`prefix.field`, or
    `guided_field` for the older spellings, when `prefix` is empty)."""

    def name(field: str) -> str:
        return f"{prefix}.{field}" if prefix else f"guided_{field}"

    out = []
    if schema is not None:
        out.append((name("json"), Grammar("json_schema", _schema_text(schema, name("json")))))
    if regex is not None:
        out.append((name("regex"), Grammar("regex", regex)))
    if choice is not None:
        out.append((name("choice"), Grammar("ebnf", choice_grammar(choice, name("choice")))))
    if ebnf is not None:
        out.append((name("grammar"), Grammar("ebnf", ebnf)))
    if json_object:
        out.append((name("json_object"), Grammar("json_object")))
    if prefix and len(out) > 1:
        fields = ", ".join(n for n, _ in out)
        raise APIError(400, f"structured_outputs takes one constraint, not {fields}", out[1][0])
    return out


def _schema_text(schema: dict | str, param: str) -> str:
    """A JSON schema as JSON text; given as text, it must parse, and be an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"the JSON schema is not valid JSON: {e}", param) from e
        except RecursionError as e:
            raise APIError(400, "the JSON schema is nested too deeply", param) from e
    if not isinstance(schema, dict):
        raise APIError(400, "a JSON schema must be a JSON object", param)
    return json.dumps(schema, ensure_ascii=False)


def choice_grammar(choices: list[str], param: str = "choice") -> str:
    """An EBNF grammar (xgrammar's dialect) that matches exactly one of `choices`: each as
    a string literal, escaped as JSON escapes a string (xgrammar reads the same escapes)."""
    if not choices:
        raise APIError(400, "choice needs at least one string", param)
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"root ::= {literals}"


def encode_grammar(grammar: Grammar) -> bytes:
    """The grammar as msgpack: what a compile worker reads, and what its digest is of."""
    return msgspec.msgpack.encode(grammar)


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


def invalid(grammar: Grammar, message: str, param: str | None) -> APIError:
    kind = _KIND_NAMES.get(grammar.kind, "grammar")
    return APIError(400, f"the {kind} is invalid: {message}", param)


def clean_message(e: Exception) -> str:
    """xgrammar's error as a client may see it: no time, no source path, one paragraph."""
    text = str(e).strip()
    text = _CHECK_FAILED.sub("", _LOCATION.sub("", text))
    text = " ".join(text.split())
    return text[:MAX_ERROR_CHARS] or type(e).__name__


class VerdictCache:
    """Verdicts of grammars compiled, by digest: "" (it compiled) or xgrammar's message,
    the `size` most recently used. What it holds is bounded by construction, whatever
    the grammars: `size` entries of a 16-byte key and a message of `MAX_ERROR_CHARS`
    at most (under 10 MB for 4096)."""

    def __init__(self, size: int = SEEN_GRAMMARS) -> None:
        self.size = size
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, key: bytes) -> str | None:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    def put(self, key: bytes, verdict: str) -> None:
        self._verdicts[key] = verdict[:MAX_ERROR_CHARS]
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.size:
            self._verdicts.popitem(last=False)


class GrammarCheck:
    """The server's grammar check: a verdict from the cache, or a compile in the pool's
    worker processes under `timeout` seconds (0: none), the wait for a worker included.

    `counts` holds the checks by result: "cold" (compiled now), "cached" (a verdict
    from the cache), "error" (it does not compile) and "timeout"; `on_compile(result,
    seconds)`, when given, sees each (the `/metrics` figures). Used from one event loop.
    """

    def __init__(
        self,
        pool: GrammarPool,
        timeout: float,
        vocab: tuple[int, list[int]],
        on_compile: Callable[[str, float], None] | None = None,
    ) -> None:
        self.pool = pool
        self.timeout = timeout
        self.vocab = vocab  # what it was made for
        self.on_compile = on_compile
        self.verdicts = VerdictCache()
        self.counts = {"cold": 0, "cached": 0, "error": 0, "timeout": 0}

    async def check(self, grammar: Grammar, param: str | None = None) -> None:
        """APIError 400 if `grammar` does not compile, or not in time; 503 if no worker was
        free in time, or the pool is gone (PoolError is raised with it: its owner makes
        another)."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout if self.timeout > 0 else None
        if len(grammar.spec) <= INLINE_BYTES // 4:
            payload = encode_grammar(grammar)
            key = digest(payload)
        else:  # a large spec's copy and hash stay off the event loop
            payload, key = await asyncio.to_thread(_encoded, grammar)
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = await self._compile(grammar, payload, deadline, param)
            self.verdicts.put(key, verdict)
            result = "cold" if verdict == _OK else "error"
        else:
            result = "cached" if verdict == _OK else "error"
        self._count(result, time.perf_counter() - start)
        if verdict != _OK:
            raise invalid(grammar, verdict, param)

    async def _compile(
        self, grammar: Grammar, payload: bytes, deadline: float | None, param: str | None
    ) -> str:
        """The verdict of a compile in the pool; what is not a verdict raises APIError (a
        worker that ended during the compile too, uncached: that may not be the grammar's
        doing)."""
        start = time.perf_counter()
        try:
            error = await self.pool.compile(payload, deadline)
        except CompileTimeout:
            self._count("timeout", time.perf_counter() - start)
            limit = f"{self.timeout:g} s"
            raise APIError(
                400, f"compiling the grammar took longer than this server's limit of {limit}", param
            ) from None
        except PoolBusy:
            raise APIError(
                503,
                f"the server is busy: no grammar compiler was free within {self.timeout:g} s",
                headers={"Retry-After": "1"},
            ) from None
        except WorkerDied:
            self._count("error", time.perf_counter() - start)
            kind = _KIND_NAMES.get(grammar.kind, "grammar")
            raise APIError(
                400, f"the {kind} could not be compiled: its compile ended the compiler's "
                "process (out of memory?)", param,
            ) from None  # fmt: skip
        except PoolError as e:
            raise APIError(
                503, f"structured outputs are restarting: {e}", headers={"Retry-After": "1"}
            ) from e
        return _OK if error is None else error

    def close(self) -> None:
        self.pool.close()

    def _count(self, result: str, seconds: float) -> None:
        self.counts[result] += 1
        if self.on_compile is not None:
            self.on_compile(result, seconds)


def _encoded(grammar: Grammar) -> tuple[bytes, bytes]:
    payload = encode_grammar(grammar)
    return payload, digest(payload)


class GrammarChecker:
    """Compiles grammars for one engine's vocabulary in this process, to refuse those that
    do not compile (`GrammarCheck` does it for the server, in killable processes).

    Thread-safe (the pipeline calls it from its worker threads). `counts` holds the
    compiles by result: "cold" (first seen here), "cached" (compiled here before:
    the compiler's cache serves it) and "error"; `seconds` their total time.
    `on_compile(result, seconds)`, when given, sees each (the `/metrics` figures).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        on_compile: Callable[[str, float], None] | None = None,
    ) -> None:
        import xgrammar as xgr  # a heavy import, only for servers that compile grammars

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=COMPILE_THREADS, cache_enabled=True, cache_limit_bytes=CACHE_BYTES
        )
        self.vocab = (vocab_size, list(eos_token_ids))  # what it was made for
        self.on_compile = on_compile
        self.counts = {"cold": 0, "cached": 0, "error": 0}
        self.seconds = 0.0
        self._seen = VerdictCache()  # digests of the grammars compiled
        self._lock = threading.Lock()

    def check(self, grammar: Grammar, param: str | None = None) -> None:
        """Compile `grammar`; APIError 400 with xgrammar's message if it does not compile."""
        key = digest(encode_grammar(grammar))
        with self._lock:
            seen = self._seen.get(key) is not None
        start = time.perf_counter()
        try:
            compile_grammar(self.compiler, grammar)
        except Exception as e:  # xgrammar raises RuntimeError (and a few others) for bad input
            self._count("error", time.perf_counter() - start)
            raise invalid(grammar, clean_message(e), param) from None
        self._count("cached" if seen else "cold", time.perf_counter() - start)
        with self._lock:
            self._seen.put(key, _OK)

    def _count(self, result: str, seconds: float) -> None:
        with self._lock:
            self.counts[result] += 1
            self.seconds += seconds
        if self.on_compile is not None:
            self.on_compile(result, seconds)


_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar",
               "json_object": "JSON grammar", "structural_tag": "tool call grammar"}  # fmt: skip
