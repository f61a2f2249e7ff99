"""`--tool-call-parser qwen3_coder`: Qwen3-Coder's calls, XML-ish blocks of text values.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

As vLLM's `qwen3_coder` parser reads them: a `<tool_call>` block holds one or more
`<function=NAME>...</function>`, each of `<parameter=KEY>VALUE</parameter>`s; a
bare `<function=...>...</function>` outside a block is a call too (vLLM's fallback
for output without `<tool_call>`), and a parameter's `</parameter>` may be left
out (its value then ends at the next `<parameter=` or at `</function>`). A value
loses one leading and one trailing newline and is typed by the parameter's schema
in the request's tools (`typed_value`); the call's arguments are the JSON object
of the parameters. A function that is not among the tools is still a call, its
values text, as vLLM's (and as the other formats, which do not know the tools).

The blocks are found as `HermesParser` finds its own (the same holding back of text
that may begin a marker, the same content around blocks, the same cost per piece);
a block's calls are given whole when it closes. A block that is not calls (text
outside its functions, a function never closed, a name with a space) is content.

Where vLLM's differs: it drops all text after the first block (here it is content,
as `hermes`'s), takes a bare function only if the output has no `<tool_call>`
(here always), makes a call of a function cut off at the end (here a last
`<tool_call>` left open is a call only if its functions are closed: an output cut
by max_tokens gives no call of half its arguments), and makes a boolean that is
not true or false false (here it stays text).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from subway.frontend.tool_parsers import (
    CALL_END,
    CALL_START,
    MAX_JSON_DEPTH,
    HermesParser,
    json_depth,
)

FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
NAME = re.compile(r"[^\s<>]+")  # a function's or a parameter's name


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # NaN, Infinity: not JSON


def _literal(text: str) -> Any:
    """`text` as a JSON value, or a Python literal (vLLM reads `{'a': True}` too); a
    ValueError if it is neither, or nests past `MAX_JSON_DEPTH`."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError("too deep")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text.strip())
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError("not a literal") from e


def _as(kind: str, value: str) -> tuple[bool, Any]:
    """(True, the value) if `value` reads as JSON schema type `kind`, else (False, None)."""
    if kind == "boolean":
        word = value.strip().lower()
        return (True, word == "true") if word in ("true", "false") else (False, None)
    if kind not in ("integer", "number", "object", "array"):
        return False, None
    try:
        v = (
            _literal(value)
            if kind in ("object", "array")
            else json.loads(value, parse_constant=_no_constant)
        )
        text = json.dumps(v, allow_nan=False)  # a set, bytes, ...: not JSON
        if json_depth(text) > MAX_JSON_DEPTH:  # a Python literal's tuples nest too
            return False, None
        v = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return False, None
    if kind == "object":
        return isinstance(v, dict), v
    if kind == "array":
        return isinstance(v, list), v
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False, None
    if isinstance(v, float):
        if not math.isfinite(v) or (kind == "integer" and not v.is_integer()):
            return False, None
        if v.is_integer():  # 3.0 is 3, as vLLM gives it
            v = int(v)
    return True, v


def typed_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says: "null" (any case) is null whatever
    the type (vLLM's); an integer, number, boolean, object or array is parsed, and stays
    the text if it does not parse as one (vLLM makes a bad boolean false); a string, a
    schema without `type` (`anyOf`, `$ref`, ...) or no schema (a parameter or function
    not in the tools) gives the text. Of a list of types, the first that reads wins."""
    if value.lower() == "null":
        return None
    kinds = schema.get("type") if isinstance(schema, dict) else None
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "string":
            return value
        ok, v = _as(kind, value) if isinstance(kind, str) else (False, None)
        if ok:
            return v
    return value


def _function(text: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of `NAME>` and its parameters (a function's text
    between `<function=` and `</function>`), or None if it is not one."""
    name, gt, rest = text.partition(">")
    if not gt or not NAME.fullmatch(name):
        return None
    chunks = rest.split(PARAMETER_START)
    if chunks[0].strip():
        return None
    properties = tools.get(name, {})
    args: dict[str, Any] = {}
    for chunk in chunks[1:]:
        key, gt, value = chunk.partition(">")
        if not gt or not NAME.fullmatch(key):
            return None
        value, end, after = value.partition(PARAMETER_END)
        if end and after.strip():
            return None
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = typed_value(value, properties.get(key))
    return name, json.dumps(args, ensure_ascii=False)


def xml_calls(body: str, tools: dict[str, dict]) -> list[tuple[str, str]] | None:
    """The calls of a `<tool_call>` block's body: its functions, blank text around them;
    None if it is anything else (one pass over the body, however many functions)."""
    calls: list[tuple[str, str]] = []
    pos = 0
    while (start := body.find(FUNCTION_START, pos)) >= 0:
        end = body.find(FUNCTION_END, start)
        if end < 0 or body[pos:start].strip():
            return None
        call = _function(body[start + len(FUNCTION_START) : end], tools)
        if call is None:
            return None
        calls.append(call)
        pos = end + len(FUNCTION_END)
    return None if body[pos:].strip() else calls or None


def tool_properties(tools: list | None) -> dict[str, dict]:
    """Each tool's parameters' `properties` (the schema of each parameter), by name."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        params = tool.function.parameters
        props = params.get("properties") if isinstance(params, dict) else None
        out[tool.function.name] = props if isinstance(props, dict) else {}
    return out


class Qwen3CoderParser(HermesParser):
    """`qwen3_coder`: content, then `<tool_call>` blocks of `<function=...>` calls (or bare
    `<function=...>` calls); `tools`: the request's, whose schemas type the values."""

    OPENS = {CALL_START: CALL_END, FUNCTION_START: FUNCTION_END}

    def __init__(self, tools: list | None = None) -> None:
        super().__init__()
        self.tools = tool_properties(tools)

    def block_calls(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        if self.start == FUNCTION_START:  # a bare function: a call only once closed
            call = _function(body, self.tools) if closed else None
            return None if call is None else [call]
        return xml_calls(body, self.tools)
