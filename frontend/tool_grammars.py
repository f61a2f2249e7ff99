"""`tool_choice` "required" and named functions, constrained in the format of calls the
model writes (`--tool-call-parser`, `tool_formats.py`), so that a forced call is the
text the model was trained to write and the same parser reads it as reads free calls.

The constraint is an xgrammar structural tag (`Grammar` kind "structural_tag"): one
tag per callable function, its arguments held to the function's parameters' schema
(JSON with at most `MAX_JSON_WHITESPACE` blanks in a row, as every JSON grammar here),
one call or more ("required"; one only without `parallel_tool_calls`), exactly one
of the named function, and nothing else before or after:

- `hermes`: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks, a
  newline apart;
- `llama3_json`: `{"name": "f", "parameters": {...}}` objects, `; ` apart;
- `mistral`: `[TOOL_CALLS][` and the `{"name": "f", "arguments": {...}}` objects, `, `
  apart, then `]`;
- `qwen3_coder`: `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n...
  </function>\\n</tool_call>` blocks (xgrammar's `qwen_xml` style of the schema);
- `pythonic`: `[f(k=value, ...), ...]`: keywords in the schema's order, each required
  one present, values Python literals typed by the schema where it says a type
  (`python_value`), any literal where it does not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from subway.ipc.grammar_build import MAX_JSON_WHITESPACE
from subway.ipc.messages import Grammar

# Python literals (EBNF, xgrammar's dialect): what a value of no known type may be.
PYTHON_LITERALS = r"""
pv ::= ps | pn | "True" | "False" | "None" | pl | pd
ps ::= "\"" ([^"\\\n] | "\\" [\\"'nrt])* "\""
pi ::= "-"? [0-9]+
pn ::= pi ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
pl ::= "[" (pv (", " pv)*)? "]"
pd ::= "{" (ps ": " pv (", " ps ": " pv)*)? "}"
"""
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_DEPTH = 8  # nesting of a pythonic value's schema followed; deeper: any literal


def forced_calls(fmt: str, functions: list[tuple[str, dict]], at_most_one: bool) -> Grammar:
    """The constraint of one call or more (at most one if `at_most_one`) of `functions`
    (name, parameters' schema) in format `fmt`."""
    if fmt == "pythonic":
        calls: dict = {
            "type": "tags_with_separator",
            "tags": [_python_tag(name, schema) for name, schema in functions],
            "separator": ", ",
            "at_least_one": True,
            "stop_after_first": at_most_one,
        }
        body: dict = _sequence("[", calls, "]")
    else:
        head, end, separator, style = FORMATS[fmt]
        tags = [
            {
                "type": "tag",
                "begin": head.replace("NAME", json.dumps(name, ensure_ascii=False)[1:-1]
                                      if not style else name),
                "content": _arguments(schema, style),
                "end": end,
            }
            for name, schema in functions
        ]  # fmt: skip
        body = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": at_most_one,
        }
        if fmt == "mistral":
            body = _sequence("[TOOL_CALLS][", body, "]")
    spec = {"type": "structural_tag", "format": body}
    return Grammar("structural_tag", json.dumps(spec, ensure_ascii=False))


# format: (a call's text before its arguments, NAME its function's name (JSON-escaped in
# JSON); after them; the separator of calls; xgrammar's style of the arguments' schema)
FORMATS: dict[str, tuple[str, str, str, str]] = {
    "hermes": ('<tool_call>\n{"name": "NAME", "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3_json": ('{"name": "NAME", "parameters": ', "}", "; ", ""),
    "mistral": ('{"name": "NAME", "arguments": ', "}", ", ", ""),
    "qwen3_coder": (
        "<tool_call>\n<function=NAME>\n",
        "</function>\n</tool_call>",
        "\n",
        "qwen_xml",
    ),
}


def _arguments(schema: dict, style: str) -> dict:
    content: dict = {
        "type": "json_schema",
        "json_schema": schema,
        "max_whitespace_cnt": 2 if style else MAX_JSON_WHITESPACE,
    }
    if style:
        content["style"] = style
    return content


def _sequence(before: str, body: dict, after: str) -> dict:
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": before},
            body,
            {"type": "const_string", "value": after},
        ],
    }


# ---------------------------------------------------------------- pythonic


def _python_tag(name: str, schema: dict) -> dict:
    rules: list[str] = []
    root = _python_arguments(schema, rules)
    grammar = f"root ::= {root}\n" + "\n".join(rules) + PYTHON_LITERALS
    return {
        "type": "tag",
        "begin": name + "(",
        "content": {"type": "grammar", "grammar": grammar},
        "end": ")",
    }


def _python_arguments(schema: dict, rules: list[str]) -> str:
    """The keyword arguments of a call to a function of parameters `schema`: each property
    in order, a required one always (rules `aF<i>`: before any argument, `aT<i>`: after
    one, so that commas fall between arguments only)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not all(IDENTIFIER.match(k) for k in props):
        return '([A-Za-z_] [A-Za-z0-9_]* "=" pv ("," " " [A-Za-z_] [A-Za-z0-9_]* "=" pv)*)?'
    required = set(schema.get("required") or ())
    names = list(props)
    n = len(names)
    rules.append(f'aF{n} ::= ""')
    rules.append(f'aT{n} ::= ""')
    for i in range(n - 1, -1, -1):
        arg = f'"{names[i]}=" {python_value(props[names[i]], rules, 0)}'
        skip = names[i] not in required
        rules.append(f"aF{i} ::= {arg} aT{i + 1}" + (f" | aF{i + 1}" if skip else ""))
        rules.append(f'aT{i} ::= ", " {arg} aT{i + 1}' + (f" | aT{i + 1}" if skip else ""))
    return "aF0"


def python_value(schema: Any, rules: list[str], depth: int) -> str:
    """An EBNF expression of the Python literals `schema` allows (where it names a type
    this follows; anything else is any literal, `pv`)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return "pv"
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return "(" + " | ".join(_ebnf_string(_literal(v)) for v in schema["enum"]) + ")"
    if "const" in schema:
        return _ebnf_string(_literal(schema["const"]))
    kind = schema.get("type")
    if kind == "string":
        return "ps"
    if kind == "integer":
        return "pi"
    if kind == "number":
        return "pn"
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    if kind == "array":
        item = python_value(schema.get("items"), rules, depth + 1)
        return f'("[" ({item} (", " {item})*)? "]")'
    if kind == "object":
        return "pd"
    return "pv"


def _literal(value: Any) -> str:
    """A JSON value as the Python literal the model writes (strings in double quotes)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def _ebnf_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string's escapes are EBNF's
