"""How a `Grammar` of the contract compiles with xgrammar: the one place, for the
frontend's check (`frontend/grammar.py`) and for the worker that masks with it
(`worker/grammar.py`), so that both always compile the same thing.

`Grammar.think` puts a reasoning model's think block before the constraint (the
answer is held to the grammar only after `</think>`, as vLLM holds it): "open"
when the prompt opened the block (DeepSeek-R1's template: the output is reasoning
up to `</think>`), "optional" when the output may start with one (Qwen3's). The
block's text is anything without `</think>` (`THINK_BODY`: the automaton of the
marker, written as rules, since the marker's `<` occurs only at its start), and
at most two blank characters may follow it before the answer.

A JSON grammar allows at most `MAX_JSON_WHITESPACE` whitespace characters in a row
(compact ones only json.dumps' separators), so that no output is a run of blanks.
"""

from __future__ import annotations

from subway.ipc.grammar_messages import JSON_OBJECT_SCHEMA, Grammar

THINK_START, THINK_END = "<think>", "</think>"
# Whitespace characters at most between two tokens of a JSON output (xgrammar's
# `max_whitespace_cnt`): room for pretty-printing ("\n" and an indent 16 deep), none for
# a small model to spend its max_tokens on a run of blanks. Compact JSON (vLLM's
# `disable_any_whitespace`) allows only json.dumps' ", " and ": ".
MAX_JSON_WHITESPACE = 20


def _think_body() -> str:
    """Rules `t0`..`t7`: text without `</think>` (state k: k characters of it matched)."""
    rules = ['t0 ::= "" | [^<] t0 | "<" t1']
    for k in range(1, len(THINK_END)):
        ch = THINK_END[k]
        more = f' | "{ch}" t{k + 1}' if k + 1 < len(THINK_END) else ""
        rules.append(f't{k} ::= "" | [^<{ch}] t0 | "<" t1{more}')
    return "\n".join(rules)


THINK_BODY = _think_body()
THINK_RULES = {
    "open": f'root ::= t0 "{THINK_END}" [ \\n]? [ \\n]?\n{THINK_BODY}',
    "optional": f'root ::= ("{THINK_START}" t0 "{THINK_END}" [ \\n]? [ \\n]?)?\n{THINK_BODY}',
}


def json_whitespace(grammar: Grammar) -> dict:
    """xgrammar's whitespace options of a JSON grammar: compact, or runs bounded."""
    if grammar.compact:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def compile_grammar(compiler, grammar: Grammar):
    """`grammar` compiled by xgrammar's `compiler` (cached there); raises what xgrammar
    raises for one that does not compile, ValueError for an unknown kind or think."""
    spec = grammar.spec if grammar.kind != "json_object" else JSON_OBJECT_SCHEMA
    if not grammar.think:
        if grammar.kind in ("json_schema", "json_object"):
            return compiler.compile_json_schema(spec, **json_whitespace(grammar))
        if grammar.kind == "regex":
            return compiler.compile_regex(spec)
        if grammar.kind == "ebnf":
            return compiler.compile_grammar(spec)
        if grammar.kind == "structural_tag":
            return compiler.compile_structural_tag(spec)
        raise ValueError(f"unknown grammar kind {grammar.kind!r}")
    import xgrammar as xgr  # only where a grammar compiles (2 s of a process's start)

    if grammar.think not in THINK_RULES:
        raise ValueError(f"unknown think block {grammar.think!r}")
    if grammar.kind in ("json_schema", "json_object"):
        answer = xgr.Grammar.from_json_schema(spec, **json_whitespace(grammar))
    elif grammar.kind == "regex":
        answer = xgr.Grammar.from_regex(spec)
    elif grammar.kind == "ebnf":
        answer = xgr.Grammar.from_ebnf(spec)
    elif grammar.kind == "structural_tag":
        answer = xgr.Grammar.from_structural_tag(spec)
    else:
        raise ValueError(f"unknown grammar kind {grammar.kind!r}")
    think = xgr.Grammar.from_ebnf(THINK_RULES[grammar.think])
    return compiler.compile_grammar(xgr.Grammar.concat(think, answer))
