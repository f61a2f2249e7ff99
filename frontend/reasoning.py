"""`--reasoning-parser`: a chat answer's `<think>...</think>` block apart from the answer.

Reasoning models write their thoughts first, between `<think>` and `</think>`;
clients (vLLM's) expect them as the message's `reasoning_content`, the rest as
its `content`. A `ReasoningParser` (one per choice) splits the output as it
streams: `feed` takes each new piece of text and returns the (reasoning,
content) text it can tell; `finish` returns what it held back. Text that may
be the start of a marker (`"</thi"`, or a first `"<th"`) is held until the
next piece tells, so that however the output is cut into pieces, the joined
reasoning and content are the same as the whole output's. What happens when:

- `deepseek_r1` (vLLM's): the output may start with `<think>` (stripped), or
  not (R1's template writes `<think>\\n` into the prompt): everything before
  the first `</think>` is reasoning, everything after it content. An output
  without `</think>` (cut by `max_tokens`, or a model that never closes) is
  all reasoning.
- `qwen3`: reasoning only if the output starts with `<think>` (Qwen3 thinking;
  with `enable_thinking: false` the template closes an empty block in the
  prompt and the output is the answer alone): from there to `</think>` is
  reasoning, the rest content; a block left open (cut) stays reasoning, as vLLM
  streams it and as its current parser answers it whole. An output that does
  not start with `<think>` is all content.

Both: blank text before a first `<think>` goes with the marker; the markers are
dropped and nothing else is (the `"\\n\\n"` after `</think>` is content's, as
vLLM keeps it); `<think>` is only a marker at the start; after `</think>` the
text is content whatever it holds, further `<think>` blocks included. The
markers are matched as text, whatever the tokens that wrote them. An output
held to a grammar from its first token (`reasoning_parser`'s `constrained`: a
regex, choice or EBNF grammar; a JSON one holds only the answer, after the
thinking, `chat.after_thinking`) splits as qwen3's whichever the parser.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One choice's output in, (reasoning, content) text out; `finish` once it has ended.

    `implicit`: an output that does not start with `<think>` is reasoning until
    `</think>` (deepseek_r1), rather than all content (qwen3)."""

    def __init__(self, implicit: bool) -> None:
        self.implicit = implicit
        self.state = "start"  # "start": before the first non-blank text; "reasoning"; "content"
        self.blank: list[str] = []  # "start": the blank text so far
        self.head = ""  # "start": the text after it, while it may begin `<think>`
        self.tail = ""  # "reasoning": the end held back, that may begin `</think>`

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        if self.state == "start":
            text = self._start(text)
            if self.state == "start":
                return "", ""
            if self.state == "content":
                return "", text
        return self._reasoning(text)

    def finish(self) -> tuple[str, str]:
        if self.state == "start":  # the output was blank, or a piece of `<think>`
            text = "".join(self.blank) + self.head
            self.blank, self.head = [], ""
            self.state = "reasoning" if self.implicit else "content"
            return (text, "") if self.implicit else ("", text)
        tail, self.tail = self.tail, ""
        return tail, ""

    def _start(self, text: str) -> str:
        """Before the output's first non-blank text: the text once the output's start has
        told the state (reasoning, or content), with its `<think>` dropped."""
        if not self.head:
            stripped = text.lstrip()
            self.blank.append(text[: len(text) - len(stripped)])
            text = stripped
        self.head += text
        if not self.head or (len(self.head) < len(START) and START.startswith(self.head)):
            return ""  # blank, or it may still be `<think>`
        head, self.head = self.head, ""
        blank = "".join(self.blank)
        self.blank = []
        if head.startswith(START):
            self.state = "reasoning"
            return head[len(START) :]
        self.state = "reasoning" if self.implicit else "content"
        return blank + head

    def _reasoning(self, text: str) -> tuple[str, str]:
        buf = self.tail + text
        at = buf.find(END)
        if at >= 0:
            self.tail, self.state = "", "content"
            return buf[:at], buf[at + len(END) :]
        keep = held(buf[-len(END) :], END)
        self.tail = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], ""


def reasoning_parser(name: str, constrained: bool = False) -> ReasoningParser | None:
    """A parser for one choice, by `--reasoning-parser`'s name ("": none). `constrained`:
    the output is held to a grammar from its first token, so it reasons only if it starts
    with `<think>` (deepseek_r1's JSON answer is not reasoning)."""
    if not name:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (one of {', '.join(PARSERS)})")
    return ReasoningParser(implicit=name == "deepseek_r1" and not constrained)


def split(name: str, text: str, constrained: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, content), as `name`'s parser fed it at once."""
    parser = reasoning_parser(name, constrained)
    if parser is None:
        return "", text
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
