"""The grammar messages of the contract (`messages.py` re-exports them): a request's
output constraint, and how each grammar reaches the workers once (`scheduler/grammars.py`)."""

from __future__ import annotations

import hashlib

import msgspec

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what kind json_object compiles as, on both sides
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's spec, at most (1 MiB of text)


class Grammar(msgspec.Struct, array_like=True, frozen=True):
    """An output constraint (structured outputs, tool calls), applied by rank 0's sampler.

    `kind` is one of `GRAMMAR_KINDS`; `spec` the JSON schema as text, the regex, the
    EBNF grammar (xgrammar's dialect) or xgrammar's structural tag as JSON (forced tool
    calls, `frontend/tool_grammars.py`), empty for `json_object` (any JSON object).
    The frontend compiles it first (a bad or slow one is a 400 there); the worker
    compiles it again with its own cache, off the step's critical path.
    """

    kind: str
    spec: str = ""
    # JSON kinds: no free whitespace (", " and ": " only, as json.dumps writes it), vLLM's
    # disable_any_whitespace; small models otherwise can spend max_tokens on whitespace.
    compact: bool = False
    # Set by the scheduler in the `NewSeq` it sends (with `spec` emptied): the grammar's
    # `grammar_key`, whose text reached the workers once, in a `GrammarPrepare`.
    key: int = 0
    # A reasoning model's think block before the constraint (`grammar_build.py`): "" none,
    # "open" (the prompt opened it: reasoning up to `</think>`), "optional" (`<think>...`).
    think: str = ""


def grammar_key(g: Grammar) -> int:
    """A grammar's content hash (63 bits, never 0): its name on the workers."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{g.kind}\0{int(g.compact)}\0{g.think}\0".encode())
    h.update(g.spec.encode("utf-8", "surrogatepass"))
    return (int.from_bytes(h.digest(), "little") >> 1) or 1


class GrammarPrepare(msgspec.Struct, tag="grammar"):
    """Compile `grammar` (rank 0) and answer with a `GrammarReady`: each grammar's text
    crosses to the workers once, however many sequences use it; `NewSeq`s name it by `key`
    (`grammar_key`). The workers keep it until a `GrammarRelease` names it."""

    key: int
    grammar: Grammar


class GrammarRelease(msgspec.Struct, tag="grammar_release"):
    """No live request uses these grammars any more (sequences already made keep theirs)."""

    keys: list[int]


class GrammarReady(msgspec.Struct, tag="grammar_ready", omit_defaults=True):
    """Rank 0's answer to a `GrammarPrepare`: compiled (`ok`), or not within the compile
    time limit or not at all (`error` says why; its requests end with an error)."""

    key: int
    ok: bool
    error: str = ""
