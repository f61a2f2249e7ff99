"""Incremental detokenization and stop strings, per request.

Token ids arrive a few at a time; the text shown to a client must be exactly
what decoding all ids at once gives, cut at the first stop string, and no piece
may hold half a character or the start of a stop string that is not yet decided.

Decoding uses the usual two offsets: `prefix_offset..read_offset` is a small
window of ids already turned into text, decoded again together with the new
ids, so that tokenizers that depend on context (leading spaces, byte-level
merges) decode the new ids as they would in the full sequence. Text ending in
U+FFFD is an incomplete UTF-8 character: it is held back until completed.

A run of ids whose text keeps ending in U+FFFD (bytes that never form a
character: a model sampling stray byte tokens) must not make the window grow
with every id, or each id would cost a decode of all of them: once more than
`MAX_HELD` ids are held, all but the last `KEEP_HELD` are released, at the
latest boundary whose text is settled (an incomplete character spans at most
3 bytes, so at most the last 3 ids; `_release_held`). Every id then costs a
bounded number of decodes of a bounded window.

Ids that decoding skips (special tokens, with `skip_special_tokens`) never
enter the window: `tokenizer.decode` drops them before it joins the rest, so
leaving them out gives the same text, and a run of them (a model that keeps
sampling EOS under `ignore_eos`) costs nothing instead of a window that grows
with every one of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt ids decoded with the first new ids, for context
MAX_HELD = 8  # ids held back (text ending in U+FFFD) before some are released anyway
KEEP_HELD = 4  # ids still held after it (an incomplete character: 3 bytes, 3 ids at most)
SPLIT_TRIES = 4  # boundaries tried for a settled one (a character spans at most 4 ids)
FORCE_HELD = 64  # past this many held ids, release at the last try even if unsettled
DECODE_PIECE = 8192  # ids one tokenizer call of `decode_long` takes at most

_skipped_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids `tokenizer.decode(..., skip_special_tokens=True)` leaves out: its special
    tokens (the special-tokens map and every added token marked special), kept only if
    they do decode to nothing when skipped and to something when not. Cached per tokenizer."""
    try:
        return _skipped_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates |= {i for i, tok in added.items() if getattr(tok, "special", False)}

    def text(i: int, skip: bool) -> str:
        return tokenizer.decode([i], skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    ids = frozenset(i for i in candidates if text(i, True) == "" and text(i, False) != "")
    try:
        _skipped_cache[tokenizer] = ids
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return ids


def decode_long(tokenizer, ids: Sequence[int], piece: int = DECODE_PIECE) -> str:
    """`tokenizer.decode(ids)` (special tokens kept, as `/detokenize` decodes), at most
    `piece` ids a tokenizer call: a fast tokenizer's decode holds the GIL from start to
    end, so one call over millions of ids would stall every thread, the event loop's too.

    Pieces are joined as `IncrementalDetokenizer` joins ids: each decoded after a few
    ids of context, and cut where the text before the cut is settled (decoding a few
    more ids does not change it: no character is split there). A tokenizer that cleans
    up spaces after decoding (a text-wide rule) decodes in one call."""
    if len(ids) <= piece or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids)

    def decode(part: Sequence[int]) -> str:
        return tokenizer.decode(part, clean_up_tokenization_spaces=False)

    out: list[str] = []
    start = 0  # the ids before it are decoded
    while start < len(ids):
        end = min(len(ids), start + piece)
        if end < len(ids):
            end = _settled_cut(decode, ids, start, end)
        context = max(0, start - PROMPT_CONTEXT)
        prefix = decode(ids[context:start]) if context < start else ""
        text = decode(ids[context:end])
        out.append(text[len(prefix) :])
        start = end
    return "".join(out)


def _settled_cut(decode, ids: Sequence[int], start: int, end: int) -> int:
    """A cut near `end` (after `start`, the latest of SPLIT_TRIES before it, else of as
    many after it) whose text the next KEEP_HELD ids leave as it is; `end` if none is."""
    before = range(end, max(start, end - SPLIT_TRIES), -1)
    after = range(end + 1, min(len(ids), end + SPLIT_TRIES) + 1)
    for cut in (*before, *after):
        lo = max(start, cut - PROMPT_CONTEXT)
        head = decode(ids[lo:cut])
        if decode(ids[lo : cut + KEEP_HELD]).startswith(head):
            return cut
    return end


class IncrementalDetokenizer:
    """Turns ids, one at a time, into text pieces that never split a character."""

    def __init__(
        self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.skipped = skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        context = self._context(prompt_ids)
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: its text would swallow ours
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last PROMPT_CONTEXT ids of the prompt that decoding keeps."""
        context: list[int] = []
        for i in reversed(prompt_ids):
            if len(context) == PROMPT_CONTEXT:
                break
            if i not in self.skipped:
                context.append(i)
        return context[::-1]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _pending(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def add(self, token_id: int) -> str:
        """Append one id; returns the text it completes (often "", never a partial character)."""
        if token_id in self.skipped:
            return ""  # decoding drops it: the window stays as it is
        self.ids.append(token_id)
        text = self._pending()
        if not text or text.endswith(REPLACEMENT):
            if len(self.ids) - self.read_offset > MAX_HELD:
                return self._release_held()
            return ""
        self._advance(len(self.ids))
        return text

    def _advance(self, read: int) -> None:
        """The ids before `read` are shown: they become the window's context."""
        self.prefix_offset = self.read_offset
        self.read_offset = read
        if self.prefix_offset > 4 * FORCE_HELD:  # drop ids no window will see again
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _release_held(self) -> str:
        """The text of all but the last `KEEP_HELD` held ids, cut at a boundary whose text
        is settled: decoding the ids up to it gives a prefix of decoding them all (a cut
        inside a character gives U+FFFD where the whole has the character). "" if no
        boundary tried is settled, until `FORCE_HELD` ids are held."""
        ids, start = self.ids, self.prefix_offset
        prefix = self._decode(ids[start : self.read_offset])
        full = self._decode(ids[start:])
        last = len(ids) - KEEP_HELD
        for cut in range(last, max(self.read_offset, last - SPLIT_TRIES), -1):
            head = self._decode(ids[start:cut])
            if len(head) > len(prefix) and full.startswith(head):
                self._advance(cut)
                return head[len(prefix) :]
        if len(ids) - self.read_offset <= FORCE_HELD:
            return ""
        head = self._decode(ids[start:last])  # no settled boundary: a bound on the cost
        self._advance(last)
        return head[len(prefix) :] if len(head) > len(prefix) else ""

    def flush(self) -> str:
        """At the end of the request: whatever is held back, incomplete characters included."""
        text = self._pending()
        self.prefix_offset = self.read_offset = len(self.ids)
        return text


class StopStringMatcher:
    """Cuts text at the first stop string, holding back any tail that may start one.

    `include_stop`: the text keeps the stop string that ended it (vLLM's
    include_stop_str_in_output). Text fed with `check=False` (a request's first
    `min_tokens` tokens) is released as it comes and matched against nothing; a
    stop string that ends after it may still start inside it, as in vLLM.

    Only the unreleased text and the last `keep` released characters (the longest
    stop string's length - 1: where a stop string ending in new text may start)
    are kept and searched, so each piece costs its own length plus that overlap,
    however long the output grows.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # the unreleased text, after at most `keep` released characters
        self.released = 0  # len of `text` already handed out
        self.stopped = False
        self.scanned = 0  # characters searched, over the matcher's life (a measure of its cost)

    def _held_tail(self) -> int:
        """Length of the longest tail of the unreleased text that is a proper prefix of a stop."""
        pending = len(self.text) - self.released
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, pending), best, -1):
                self.scanned += k
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _first_stop(self) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string that ends in unreleased text (the
        shortest of those that start there)."""
        best = None
        for stop in self.stops:
            start = max(0, self.released - len(stop) + 1)
            self.scanned += len(self.text) - start
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or (i, i + len(stop)) < best):
                best = (i, i + len(stop))
        return best

    def _release(self, end: int) -> str:
        """Hand out the text up to `end`; forget what no later stop string can reach."""
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        cut = self.released - self.keep
        if cut > 0:
            self.text = self.text[cut:]
            self.released -= cut
        return out

    def feed(self, piece: str, check: bool = True) -> str:
        """Add text; returns what may be shown now. Sets `stopped` when a stop string appears."""
        if self.stopped or not piece:
            return ""
        self.text += piece
        if not self.stops or not check:
            return self._release(len(self.text))
        hit = self._first_stop()
        if hit is not None:
            end = hit[1] if self.include_stop else hit[0]
            self.stopped = True
        else:
            end = len(self.text) - self._held_tail()
        return self._release(end)

    def flush(self) -> str:
        """At the end of the request: the held-back tail, which turned out not to be a stop."""
        if self.stopped:
            return ""
        return self._release(len(self.text))


@dataclass
class DetokenizedStep:
    text: str  # new text, safe to show
    num_tokens: int  # ids consumed: all of them, or up to the one that completed a stop string
    stopped: bool  # a stop string matched: the request is over, with finish_reason "stop"


class Detokenizer:
    """One request's output text: incremental decoding followed by stop strings.

    No stop string is matched in the text of the first `min_tokens` tokens (vLLM v1's
    min_tokens: the engine samples no EOS or stop id before then either)."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] = (),
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.decoder = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stops, include_stop)
        self.min_tokens = min_tokens
        self.num_tokens = 0  # ids added so far

    def add(self, token_ids: Sequence[int]) -> DetokenizedStep:
        pieces = []
        for i, token_id in enumerate(token_ids):
            self.num_tokens += 1
            piece = self.decoder.add(token_id)
            pieces.append(self.matcher.feed(piece, check=self.num_tokens > self.min_tokens))
            if self.matcher.stopped:
                return DetokenizedStep("".join(pieces), i + 1, True)
        return DetokenizedStep("".join(pieces), len(token_ids), False)

    def finish(self) -> DetokenizedStep:
        """The request ended on the engine's side: release everything held back."""
        text = self.matcher.feed(self.decoder.flush(), check=self.num_tokens > self.min_tokens)
        if self.matcher.stopped:
            return DetokenizedStep(text, 0, True)
        return DetokenizedStep(text + self.matcher.flush(), 0, False)
