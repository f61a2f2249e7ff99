"""Structured outputs at the frontend: a request's output constraint as a `Grammar`, and
its check (`GrammarChecker`) before the engine ever sees it.

`request_grammar` reads the constraint from whichever field gave it (OpenAI's
`response_format`; vLLM's `structured_outputs` and its older `guided_*`
spellings): one at most, across them all. A JSON schema travels as its JSON text,
a `choice` as an EBNF grammar that matches exactly one of the choices.

`GrammarChecker.check` compiles the grammar with xgrammar for the engine's
vocabulary: what does not compile (an invalid schema, regex or EBNF) is a 400
with xgrammar's message, so that no request reaches the engine with a grammar
its worker cannot compile. The compiler keeps what it compiled (bounded by
`CACHE_BYTES`), so a schema that many requests share costs its compile once.
The pipeline runs the check off the event loop under `--grammar-timeout`
(`pipeline.check_grammars`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from subway.frontend.errors import APIError
from subway.frontend.protocol import ResponseFormat, SamplingRequest, StructuredOutputs
from subway.ipc.messages import JSON_OBJECT_SCHEMA, MAX_GRAMMAR_CHARS, Grammar

CACHE_BYTES = 64 << 20  # what the frontend's compiler keeps of compiled grammars, at most
SEEN_GRAMMARS = 4096  # grammars remembered as compiled (to tell cached compiles from cold)
COMPILE_THREADS = 2  # xgrammar's threads for one compile
MAX_ERROR_CHARS = 500

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


def clean_message(e: Exception) -> str:
    """xgrammar's error as a client may see it: no time, no source path, one paragraph."""
    text = str(e).strip()
    text = _CHECK_FAILED.sub("", _LOCATION.sub("", text))
    text = " ".join(text.split())
    return text[:MAX_ERROR_CHARS] or type(e).__name__


class GrammarChecker:
    """Compiles grammars for one engine's vocabulary, to refuse those that do not compile.

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
        self._seen: OrderedDict[Grammar, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: Grammar, param: str | None = None) -> None:
        """Compile `grammar`; APIError 400 with xgrammar's message if it does not compile."""
        with self._lock:
            seen = grammar in self._seen
        start = time.perf_counter()
        try:
            self._compile(grammar)
        except Exception as e:  # xgrammar raises RuntimeError (and a few others) for bad input
            self._count("error", time.perf_counter() - start)
            raise APIError(
                400, f"the {_KIND_NAMES.get(grammar.kind, 'grammar')} is invalid: "
                f"{clean_message(e)}", param,
            ) from None  # fmt: skip
        self._count("cached" if seen else "cold", time.perf_counter() - start)
        with self._lock:
            self._seen[grammar] = None
            self._seen.move_to_end(grammar)
            while len(self._seen) > SEEN_GRAMMARS:
                self._seen.popitem(last=False)

    def _compile(self, grammar: Grammar) -> None:
        c = self.compiler
        if grammar.kind in ("json_schema", "json_object"):  # as the worker compiles them
            spec = grammar.spec if grammar.kind == "json_schema" else JSON_OBJECT_SCHEMA
            c.compile_json_schema(spec, any_whitespace=not grammar.compact)
        elif grammar.kind == "regex":
            c.compile_regex(grammar.spec)
        elif grammar.kind == "ebnf":
            c.compile_grammar(grammar.spec)
        else:
            raise ValueError(f"unknown grammar kind {grammar.kind!r}")

    def _count(self, result: str, seconds: float) -> None:
        with self._lock:
            self.counts[result] += 1
            self.seconds += seconds
        if self.on_compile is not None:
            self.on_compile(result, seconds)


_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar",
               "json_object": "JSON grammar"}  # fmt: skip
