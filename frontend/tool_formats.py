"""The formats of tool calls a model writes freely (tool_choice "auto"), by
`--tool-call-parser` (vLLM's names): `hermes` (`tool_parsers.HermesParser`, the
default), `llama3_json`, `mistral`, `pythonic`, `qwen3_coder`
(`tool_format_xml.Qwen3CoderParser`), and `auto`, the one the chat template asks
for (`template_format`).

Each parser keeps `tool_parsers`' contract: fed the output in any pieces it gives
the same content and calls as fed it whole, text that is not a call is content, and a
malformed call is its text, never an error. Calls are given as their text closes,
up to the first text that is not one: from there on the output is content (vLLM's
parsers make the whole output content when any part of it is not a call; a stream
cannot take back the calls it has sent). Whitespace and separators left after the
calls are dropped. Each character is looked at once, outside the JSON or Python
text of one call, which is read once it closes; nesting past `MAX_JSON_DEPTH` is no call.

- `llama3_json`: Llama 3.x: the output, after an optional `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}` (or `"arguments"`) objects, separated by `;`;
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array of
  `{"name": ..., "arguments": {...}}` (before v11), or `[TOOL_CALLS]name{...}`
  (v11); more `[TOOL_CALLS]` may follow;
- `pythonic`: the output is a Python list of calls, `[f(a=1, b="x"), g()]`, each
  argument a literal (`ast.literal_eval`), keywords only.
"""

from __future__ import annotations

import ast
import functools
import json

from subway.frontend.tool_format_xml import Qwen3CoderParser
from subway.frontend.tool_parsers import (
    MAX_JSON_DEPTH,
    CallPiece,
    HermesParser,
    Piece,
    ToolParser,
    marker_prefix,
    parse_call,
)

PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


class Brackets:
    """The bracket depth of JSON (or Python) text fed a character at a time, outside
    its strings."""

    def __init__(self, depth: int = 0, python: bool = False) -> None:
        self.depth = depth
        self.quotes, self.opens, self.closes = (
            ("\"'", "([{", ")]}") if python else ('"', "[{", "]}")
        )
        self.quote = ""  # the quote of the string we are in
        self.escaped = False

    def step(self, ch: str) -> None:
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = ""
        elif ch in self.quotes:
            self.quote = ch
        elif ch in self.opens:
            self.depth += 1
        elif ch in self.closes:
            self.depth -= 1


def arguments_json(text: str) -> str | None:
    """A JSON object's text as a call's arguments (None: it is not one)."""
    try:
        args = json.loads(text)
        return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
    except (ValueError, RecursionError):
        return None


def python_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of `name(key=literal, ...)`, or None if it is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(kw.arg is None for kw in node.keywords):
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def blank(text: str, separators: str) -> bool:
    return all(c.isspace() or c in separators for c in text)


class HeldParser(ToolParser):
    """What the formats share: the text since the last call (`parts`, then `body`, the
    call being read) is held until it is a call, or shown with all that follows as
    content from the first character that cannot be one."""

    separators = ""  # what may stand between calls, besides whitespace

    def __init__(self) -> None:
        self.parts: list[str] = []  # text since the last call, before `body`, not shown
        self.body: list[str] = []  # the call being read
        self.state = "start"
        self.scan = Brackets()

    def _fail(self, rest: str, out: list[Piece]) -> None:
        """No call: the held text and `rest` are content, and so is all that follows."""
        text = "".join(self.parts + self.body) + rest
        self.parts, self.body, self.state = [], [], "content"
        if text:
            out.append(text)

    def _call(self, call: tuple[str, str] | None, rest: str, out: list[Piece]) -> bool:
        """A call read (True), or none (False): then `_fail` with `rest`."""
        if call is None:
            self._fail(rest, out)
            return False
        out.append(CallPiece(self.calls, call[1], call[0]))
        self.calls += 1
        self.parts, self.body = [], []
        return True

    def _read(self, text: str, i: int) -> int:
        """Scan the call being read on from text[i]: the index after it closes, -1 if it
        goes on past the text, -2 if it nests too deep."""
        scan = self.scan
        for j in range(i, len(text)):
            scan.step(text[j])
            if scan.depth > MAX_JSON_DEPTH:
                return -2
            if scan.depth <= 0:
                return j + 1
        return -1

    def _lead(self, text: str, out: list[Piece], start: str) -> str | None:
        """At the start: the output from its first non-blank character once it begins with
        `start` or `PYTHON_TAG` (its blank text held), None while it may (or if it does
        not: then all of it is content)."""
        held = "".join(self.parts) + text
        lead = held.lstrip()
        self.parts = [held]
        if not lead or (PYTHON_TAG.startswith(lead) and lead != PYTHON_TAG):
            return None
        if not (lead.startswith(start) or lead.startswith(PYTHON_TAG)):
            self.parts = []
            self._fail(held, out)
            return None
        self.parts = [held[: len(held) - len(lead)]]
        return lead

    def finish(self) -> list[Piece]:
        """The held text at the end is content, unless it is only separators after a call."""
        pending = "".join(self.parts + self.body) if self.state != "content" else ""
        self.parts, self.body = [], []
        if not pending or (self.calls and blank(pending, self.separators)):
            return []
        return [pending]


class Llama3JsonParser(HeldParser):
    """`llama3_json`: `{"name": ..., "parameters": {...}}` objects separated by `;`, the
    output's first non-blank text (after an optional `<|python_tag|>`)."""

    separators = ";"

    def feed(self, text: str) -> list[Piece]:
        if self.state == "content":
            return [text] if text else []
        out: list[Piece] = []
        if self.state == "start":
            lead = self._lead(text, out, "{")
            if lead is None:
                return out
            if lead.startswith(PYTHON_TAG):
                self.parts.append(PYTHON_TAG)
                lead = lead[len(PYTHON_TAG) :]
            self.state, text = "between", lead
        begin = i = 0  # text[begin:] is in neither parts nor body
        while i < len(text):
            if self.state == "between":
                ch = text[i]
                if ch.isspace() or ch == ";":
                    i += 1
                    continue
                if ch != "{":
                    self._fail(text[begin:], out)
                    return out
                self.parts.append(text[begin:i])
                self.state, self.scan, begin = "object", Brackets(), i
            end = self._read(text, i)
            if end == -1:
                break
            body = "".join(self.body) + text[begin:end]
            call = parse_call(body, "parameters") if end > 0 else None
            if not self._call(call, text[begin:], out):
                return out
            self.state, begin, i = "between", end, end
        (self.body if self.state == "object" else self.parts).append(text[begin:])
        return out


class MistralParser(HeldParser):
    """`mistral`: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ...,
    "arguments": {...}}` objects, or (v11) a name and its arguments' JSON object;
    more `[TOOL_CALLS]` may follow."""

    separators = ","
    NAME_MAX = 128  # characters of a v11 call's name

    def __init__(self) -> None:
        super().__init__()
        self.state = "seek"  # seek, marker, array, item, name, args, content
        self.tail = ""  # seeking: the end of the text that may begin the marker
        self.shown = False  # text since the last call has been shown
        self.name: list[str] = []
        self.calls_before = 0  # calls before the last marker

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text and self.state != "content":
            text = self._seek(text, out) if self.state == "seek" else self._calls(text, out)
        if text:
            out.append(text)
        return out

    def _seek(self, text: str, out: list[Piece]) -> str:
        """Content up to a marker; the text after it ("" if none)."""
        buf, self.tail = self.tail + text, ""
        i = buf.find(TOOL_CALLS)
        if i < 0:
            keep = marker_prefix(buf[max(0, len(buf) - len(TOOL_CALLS)) :], TOOL_CALLS)
            self._show(buf[: len(buf) - keep], out)
            self.tail = buf[len(buf) - keep :]
            return ""
        self._show(buf[:i], out)
        self.parts.append(TOOL_CALLS)
        self.state, self.calls_before = "marker", self.calls
        return buf[i + len(TOOL_CALLS) :]

    def _show(self, text: str, out: list[Piece]) -> None:
        """Text of no call: shown, or held while it is blank next to calls."""
        if not text:
            return
        if self.shown or text.strip():
            out.append("".join(self.parts) + text)
            self.parts, self.shown = [], True
        else:
            self.parts.append(text)

    def _calls(self, text: str, out: list[Piece]) -> str:
        """Calls after a marker; the text after them once they end ("" if they go on)."""
        begin = i = 0  # text[begin:] is in neither parts nor body
        while i < len(text):
            ch, state = text[i], self.state
            if state in ("item", "args"):
                end = self._read(text, i)
                if end == -1:
                    break
                if not self._call(self._parsed(text[begin:end], end), text[begin:], out):
                    return ""
                begin = i = end
                self.state = "array" if state == "item" else "seek"
                if state == "args":
                    self.shown = False
                    return text[end:]
                continue
            if state == "name" and (ch.isalnum() or ch in "_-.") and len(self.name) < self.NAME_MAX:
                self.name.append(ch)
            elif state in ("marker", "array") and ch.isspace() or (state == "array" and ch == ","):
                pass
            elif state == "marker" and ch == "[":
                self.state = "array"
            elif state == "marker" and (ch.isalnum() or ch == "_"):
                self.state, self.name = "name", [ch]
            elif state == "array" and ch == "]" and self.calls > self.calls_before:
                self.state, self.shown, self.parts = "seek", False, []
                return text[i + 1 :]
            elif ch == "{" and state in ("array", "name"):
                self.parts.append(text[begin:i])
                self.state, self.scan, begin = (
                    ("item" if state == "array" else "args"),
                    Brackets(),
                    i,
                )
                continue
            else:
                self._fail(text[begin:], out)
                return ""
            i += 1
        (self.body if self.state in ("item", "args") else self.parts).append(text[begin:])
        return ""

    def _parsed(self, end_text: str, end: int) -> tuple[str, str] | None:
        if end < 0:
            return None
        body = "".join(self.body) + end_text
        if self.state == "item":
            return parse_call(body, "arguments")
        args = arguments_json(body)
        return None if args is None else ("".join(self.name), args)

    def finish(self) -> list[Piece]:
        if self.state != "seek":
            return super().finish()
        pending = "".join(self.parts) + self.tail
        self.parts, self.tail = [], ""
        return [pending] if pending and (self.shown or pending.strip() or not self.calls) else []


class PythonicParser(HeldParser):
    """`pythonic`: the output is a Python list of calls, `[f(a=1), g(b="x")]`, each
    argument a literal; text after the list is content."""

    separators = ","

    def feed(self, text: str) -> list[Piece]:
        if self.state == "content":
            return [text] if text else []
        out: list[Piece] = []
        if self.state == "start":
            lead = self._lead(text, out, "[")
            if lead is None:
                return out
            if not lead.startswith("["):  # the Llama tag: not this format
                self._fail(lead, out)
                return out
            self.parts.append("[")
            self.state, self.scan, text = "item", Brackets(1, python=True), lead[1:]
        if self.state == "after":
            self._after(text, out)
            return out
        scan, begin = self.scan, 0
        for i, ch in enumerate(text):
            scan.step(ch)
            if scan.depth > MAX_JSON_DEPTH or (scan.depth == 0 and ch != "]"):
                self._fail(text[begin:], out)
                return out
            if scan.depth == 0 or (ch == "," and scan.depth == 1 and not scan.quote):
                item = "".join(self.body) + text[begin:i]
                trailing = scan.depth == 0 and self.calls and not item.strip()  # [f(),]
                if not (trailing or self._call(python_call(item), text[begin:], out)):
                    return out
                self.parts, self.body, begin = [ch], [], i + 1
                if scan.depth == 0:
                    self.state, self.parts = "after", []
                    self._after(text[i + 1 :], out)
                    return out
        self.body.append(text[begin:])
        return out

    def _after(self, text: str, out: list[Piece]) -> None:
        """Text after the list: content, but for blank text at the end."""
        if text.strip():
            self._fail(text, out)
        elif text:
            self.parts.append(text)

    def finish(self) -> list[Piece]:
        """A list cut short still gives its last call if it is whole."""
        if self.state == "item" and self.scan.depth == 1 and not self.scan.quote:
            call = python_call("".join(self.body))
            if call is not None:
                out: list[Piece] = []
                self._call(call, "", out)
                return out + super().finish()
        return super().finish()


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}

# `auto`: the format a chat template asks for, by the first row whose markers its text
# all holds; a template that holds none gets hermes (so does one that does not take
# tools: Subway's own system prompt asks for Hermes blocks, `tools.call_format`).
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<function=", "<parameter=")),  # Qwen3-Coder (it has <tool_call> too)
    ("mistral", (TOOL_CALLS,)),
    ("pythonic", ("[func_name1(",)),  # Llama 3.2/4's pythonic templates (vLLM's examples)
    ("llama3_json", (PYTHON_TAG,)),  # Llama 3.1/3.3
    ("llama3_json", ('"parameters": dictionary of argument name',)),  # Llama 3.x JSON
    ("hermes", ("<tool_call>",)),  # Hermes, Qwen2.5, Qwen3
)


@functools.lru_cache(maxsize=64)
def template_format(source: str) -> str:
    """The `--tool-call-parser` format a chat template's text asks for (`TEMPLATE_MARKERS`),
    decided once per template."""
    for name, markers in TEMPLATE_MARKERS:
        if all(m in source for m in markers):
            return name
    return "hermes"


def auto_parser(name: str, tools: list | None = None) -> ToolParser:
    """The parser of tool_choice "auto" under `--tool-call-parser` `name` (not `auto`, which
    `tools.call_format` resolves); `tools`: the request's (qwen3_coder types by them)."""
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools)
    return PARSERS[name]()
