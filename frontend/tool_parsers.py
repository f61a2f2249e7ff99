"""Parsers of a choice's output into tool calls, fed piece by piece as it streams.

A parser turns output text into `Piece`s: content text and `CallPiece`s. Fed the
whole text at once it gives the same content and calls, so a streamed answer and
a whole one agree. `HermesParser` (tool_choice "auto") finds
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; `ArrayParser`
("required") reads the constrained JSON array of calls; `NamedParser` (a named
function) takes the whole output as the call's arguments. Which one a request
gets is `tools.tool_parser`'s choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


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


def _call(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON, or None if it is not one. Hermes
    models write "arguments", some "parameters": `arguments_key` first, then the other."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    args = obj.get(arguments_key, obj.get(other, {}))
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesParser(ToolParser):
    """`auto`: content, then `<tool_call>` blocks. A block whose JSON is not a call stays
    content; whitespace alone between calls, or between a call and either end, is dropped;
    a last block left open is a call if its JSON is whole. Text that may begin a block's
    marker is held until the next piece tells."""

    def __init__(self) -> None:
        self.pending = ""  # outside a block: text not shown yet; inside: the block's body
        self.inside = False
        self.held = ""  # inside a block: the blank text before it, shown if it is no call
        self.shown = False  # text of the current run (since the last call) has been shown
        self.after_call = False  # the last block was a call

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self.pending += text
        while True:
            if self.inside:
                end = self.pending.find(CALL_END)
                if end < 0:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(CALL_END) :]
                self._close(body, CALL_END, out)
                continue
            start = self.pending.find(CALL_START)
            if start >= 0:
                before, self.pending = self.pending[:start], self.pending[start + len(CALL_START) :]
                if self.shown or before.strip():
                    self._show(before, out)
                    self.held = ""
                else:
                    self.held = before
                self.inside = True
                continue
            keep = _marker_prefix(self.pending, CALL_START)
            ready = self.pending[: len(self.pending) - keep]
            if self.shown or ready.strip():
                self._show(ready, out)
                self.pending = self.pending[len(ready) :]
            return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.inside:
            self._close(self.pending, "", out)
        elif self.shown or self.pending.strip() or not self.after_call:
            self._show(self.pending, out)
        self.pending = ""
        return out

    def _close(self, body: str, end: str, out: list[Piece]) -> None:
        call = _call(body, "arguments")
        self.inside = False
        if call is None:
            self._show(self.held + CALL_START + body + end, out)
            self.after_call = False
        else:
            out.append(CallPiece(self.calls, call[1], call[0]))
            self.calls += 1
            self.after_call, self.shown = True, False
        self.held = ""

    def _show(self, text: str, out: list[Piece]) -> None:
        if text:
            out.append(text)
            self.shown = True


class ArrayParser(ToolParser):
    """`required`: a JSON array of `{"name", "parameters"}` objects; each call is given
    whole once its object closes. Output that holds no call is content (the grammar
    did not hold, or the output was cut)."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.depth = 0  # nesting: 1 inside the array, 2+ inside a call
        self.in_string = False
        self.escaped = False
        self.item: list[str] = []  # the call being read

    def feed(self, text: str) -> list[Piece]:
        self.raw.append(text)
        out: list[Piece] = []
        for ch in text:
            if self.depth >= 2:
                self.item.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = self.depth >= 1
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item = [ch]
            elif ch in "]}" and self.depth > 0:
                self.depth -= 1
                if self.depth == 1:
                    self._item(out)
        return out

    def _item(self, out: list[Piece]) -> None:
        call = _call("".join(self.item), "parameters")
        self.item = []
        if call is not None:
            out.append(CallPiece(self.calls, call[1], call[0]))
            self.calls += 1

    def finish(self) -> list[Piece]:
        text = "".join(self.raw)
        return [text] if not self.calls and text else []


class NamedParser(ToolParser):
    """A named function: the output text is the arguments, streamed as it comes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self.calls:
            return [CallPiece(0, text)]
        self.calls = 1
        return [CallPiece(0, text, self.name)]

    def finish(self) -> list[Piece]:
        """A call with empty arguments if the output had no text (a cut at once)."""
        if self.calls:
            return []
        self.calls = 1
        return [CallPiece(0, "", self.name)]
