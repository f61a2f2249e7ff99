"""Parsers of a choice's output into tool calls, fed piece by piece as it streams.

A parser turns output text into `Piece`s: content text and `CallPiece`s. Fed the
whole text at once it gives the same content and calls, so a streamed answer and
a whole one agree. `HermesParser` (tool_choice "auto") finds
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the other
formats' parsers are `tool_formats.py`'s. Which one a request gets is
`tools.tool_parser`'s choice (the same for free and for forced calls).

Each piece costs its own length, however long the output: `HermesParser` searches
only the new text (after the few characters that may begin a marker) and keeps a
block's body, or the blank text it holds back, as a list of pieces; JSON nested
deeper than `MAX_JSON_DEPTH` is no call (a model's output of 10^5 "[" must neither
recurse nor be read twice).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
MAX_JSON_DEPTH = 64  # nesting of a call's JSON at most; deeper output is content
_SPECIAL = re.compile(r'[\[\]{}"\\]')  # what json_depth looks at


@dataclass
class CallPiece:
    """A piece of call `index` of a choice: the first names it, the rest add arguments."""

    index: int
    arguments: str
    name: str | None = None


Piece = str | CallPiece  # content text, or a piece of a call


class ToolParser:
    """Output text in, pieces out; `finish` once the output has ended."""

    calls = 0  # calls begun

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError


def json_depth(text: str) -> int:
    """How deep the brackets of JSON text nest (outside its strings): one pass over the
    text's brackets, quotes and backslashes."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # too few brackets to nest too deep: no scan
    depth = deepest = 0
    in_string, escaped_at = False, -1
    for m in _SPECIAL.finditer(text):
        ch, at = m.group(), m.start()
        if in_string:
            if at == escaped_at:
                continue
            if ch == "\\":
                escaped_at = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_call(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON, or None if it is not one. Hermes
    models write "arguments", some "parameters": `arguments_key` first, then the other."""
    if json_depth(text) > MAX_JSON_DEPTH:
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    args = obj.get(arguments_key, obj.get(other, {}))
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


def first_marker(
    text: str, pos: int, markers: tuple[str, ...], ahead: dict[str, int]
) -> tuple[int, str]:
    """The first of `markers` in `text` from `pos`: (its index, it), or (-1, ""). `ahead`
    keeps each marker's next index in `text` (-1: none), so that with several markers no
    character is searched twice for one."""
    at, found = -1, ""
    for m in markers:
        i = ahead.get(m, pos - 1)
        if 0 <= i < pos or m not in ahead:
            i = ahead[m] = text.find(m, pos)
        if i >= 0 and (at < 0 or i < at):
            at, found = i, m
    return at, found


def marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesParser(ToolParser):
    """`auto`: content, then `<tool_call>` blocks. A block whose JSON is not a call stays
    content; whitespace alone between calls, or between a call and either end, is dropped;
    a last block left open is a call if its JSON is whole. Text that may begin a block's
    marker is held until the next piece tells.

    A format of other blocks (`tool_format_xml.Qwen3CoderParser`) names its markers in
    `OPENS` (each block's opening marker, and the marker that closes it) and reads a
    block's body in `block_calls`."""

    OPENS = {CALL_START: CALL_END}

    def __init__(self) -> None:
        self.parts: list[str] = []  # outside a block: blank text not shown; inside: the body
        self.tail = ""  # the end of the text so far that may begin the marker sought
        self.inside = False
        self.start = CALL_START  # the marker that opened the block we are in
        self.held = ""  # inside a block: the blank text before it, shown if it is no call
        self.shown = False  # text of the current run (since the last call) has been shown
        self.after_call = False  # the last block was a call
        self.scanned = 0  # characters searched for markers, over the parser's life

    def block_calls(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        """The calls (name, arguments as JSON text) of a block's body (`closed`: its closing
        marker was read; a block left open at the end is read too); None: it is no call."""
        call = parse_call(body, "arguments")
        return None if call is None else [call]

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buf, pos = self.tail + text, 0
        self.tail = ""
        ahead: dict[str, int] = {}  # each marker's next index in buf (-1: none)
        while True:
            markers = (self.OPENS[self.start],) if self.inside else tuple(self.OPENS)
            self.scanned += len(buf) - pos
            i, marker = first_marker(buf, pos, markers, ahead)
            if i < 0:
                keep = max(marker_prefix(buf[max(pos, len(buf) - len(m)) :], m) for m in markers)
                self._take(buf[pos : len(buf) - keep], out)
                self.tail = buf[len(buf) - keep :]
                return out
            before, pos = buf[pos:i], i + len(marker)
            if self.inside:
                body = "".join(self.parts) + before
                self.parts = []
                self._close(body, marker, out)
            else:
                self._open(before, out)
                self.start = marker

    def _take(self, text: str, out: list[Piece]) -> None:
        """Text in which no marker starts: part of the body, shown, or held if blank."""
        if not text:
            return
        if self.inside or not (self.shown or text.strip()):
            self.parts.append(text)
            return
        self._show("".join(self.parts) + text, out)
        self.parts = []

    def _open(self, before: str, out: list[Piece]) -> None:
        """A block starts after `before` (and the blank text held before it)."""
        blank = "".join(self.parts)
        self.parts = []
        if self.shown or before.strip():
            self._show(blank + before, out)
            self.held = ""
        else:
            self.held = blank + before
        self.inside = True

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        pending = "".join(self.parts) + self.tail
        self.parts, self.tail = [], ""
        if self.inside:
            self._close(pending, "", out)
        elif self.shown or pending.strip() or not self.after_call:
            self._show(pending, out)
        return out

    def _close(self, body: str, end: str, out: list[Piece]) -> None:
        calls = self.block_calls(body, bool(end))
        self.inside = False
        if calls is None:
            self._show(self.held + self.start + body + end, out)
            self.after_call = False
        else:
            for name, arguments in calls:
                out.append(CallPiece(self.calls, arguments, name))
                self.calls += 1
            self.after_call, self.shown = True, False
        self.held = ""

    def _show(self, text: str, out: list[Piece]) -> None:
        if text:
            out.append(text)
            self.shown = True
