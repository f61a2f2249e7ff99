"""A JSON output closes before its budget runs out.

A small model sampled under a JSON schema can keep writing inside a free-form
string (or keep adding array items) until `max_tokens` cuts it, and a cut JSON
does not parse. So, in its last `window` tokens, a JSON-constrained row's
allowed set is narrowed further, in tiers, each used where the grammar allows
any of it:

1. its *closing* tokens: text made only of `"`, `]` and `}` (a string, an
   array, an object closes), or an empty `[]` or `{}` (a value that closes as
   it opens), either after at most one space; and the end-of-sequence tokens (a
   complete JSON ends). Inside a string, where `]` and `}` are only text, those
   that start with the `"` that ends it (`"`, `"}`, `"]}`...): a row is inside a
   string when its grammar allows both the `]` token and the `}` token, which no
   place in JSON's structure does (after a value exactly one of them closes the
   innermost container);
2. else (the grammar needs a key, a comma, a colon, a digit) its tokens that are
   not whitespace alone: whitespace makes no progress and runs on as a string
   does (measured: indentation to `max_tokens`);
3. else the grammar's own mask, unchanged.

The row is narrowed again at the next step. The narrowing only removes tokens
from the grammar's set, never all of them, so every output still follows the
grammar; a row outside its window is untouched, bit for bit.

Which rows (`in_window`): a JSON grammar (`json_schema` or `json_object`)
without a think block (a reasoning model's think text is not JSON: narrowing
it would write `"}]` inside the reasoning), without `ignore_eos` (the request
asks for exactly `max_tokens` tokens, as a benchmark does: the grammar alone
decides), once `min_tokens` tokens are out (a JSON closed earlier could only
end, and the grammar would win over `min_tokens`), and within `window` tokens
of `max_tokens`. `max_tokens` is the budget: the frontend resolves an absent
one to the rest of the context, so the window then closes the JSON before the
context ends. Each row's decision reads only its own parameters and count of
generated tokens, and its narrowing only its own mask row: the same result
whatever else is in the batch.

The window (`DEFAULT_WINDOW`, tokens; `SUBWAY_JSON_CLOSING_WINDOW` overrides,
0 turns the feature off) was picked by measurement
(`tools/bench/bench_json_validity.py`, docs/BENCHMARKS.md): long enough to
finish the object being written, with its required keys, and close what
encloses it; short enough that answers that end on their own are rarely cut.

Speculative decoding never drafts for a constrained sequence, so a masked row
is one sequence's only row; tensor parallelism masks on rank 0 only, which
broadcasts the tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from subway.ipc.messages import SamplingParams

DEFAULT_WINDOW = 48  # 32 left 97 of 100 valid on one schema in one run; 48 gave 100 on all four
WINDOW_ENV = "SUBWAY_JSON_CLOSING_WINDOW"
CLOSING_BYTES = frozenset(b'"]}')
EMPTY_CONTAINERS = (b"[]", b"{}")
JSON_KINDS = ("json_schema", "json_object")


class Row(Protocol):
    """What a sampled row tells (`sampler.SampleRequest`)."""

    params: SamplingParams
    num_generated: int


def window_from_env() -> int:
    """The closing window: `SUBWAY_JSON_CLOSING_WINDOW` if it is a whole number >= 0, else
    `DEFAULT_WINDOW`."""
    text = os.environ.get(WINDOW_ENV, "").strip()
    try:
        value = int(text)
    except ValueError:
        return DEFAULT_WINDOW
    return value if value >= 0 else DEFAULT_WINDOW


def is_blank(text: bytes) -> bool:
    """Whether a token's text is only whitespace (JSON's: space, tab, newline, return)."""
    return bool(text) and all(b in b" \t\n\r" for b in text)


def is_closing(text: bytes) -> bool:
    """Whether a token's text closes JSON structures and does nothing else: after at most
    one space, only `"`, `]` and `}`, or an empty array or object (a value that closes as
    it opens: `"members": []` rather than a first member)."""
    core = text[1:] if text[:1] == b" " else text
    return bool(core) and (core in EMPTY_CONTAINERS or all(b in CLOSING_BYTES for b in core))


def ends_string(text: bytes) -> bool:
    """Whether a token's text, inside a string, ends it and closes nothing but structures:
    a `"` then only `]` and `}`."""
    return text[:1] == b'"' and all(b in b"]}" for b in text[1:])


def closing_token_ids(decoded_vocab: Sequence[bytes], stop_ids: Iterable[int]) -> list[int]:
    """The closing tokens of a vocabulary (xgrammar's `TokenizerInfo.decoded_vocab`) and
    its stop tokens, sorted."""
    ids = {i for i, text in enumerate(decoded_vocab) if is_closing(bytes(text))}
    ids.update(i for i in stop_ids if 0 <= i < len(decoded_vocab))
    return sorted(ids)


def string_closing_token_ids(decoded_vocab: Sequence[bytes]) -> list[int]:
    """The tokens that end a string (`ends_string`), sorted."""
    return [i for i, text in enumerate(decoded_vocab) if ends_string(bytes(text))]


def bracket_ids(decoded_vocab: Sequence[bytes]) -> tuple[int, int] | None:
    """The ids of the `]` token and the `}` token (the first of each), or None if the
    vocabulary lacks one: both allowed means inside a string."""
    found: dict[bytes, int] = {}
    for i, text in enumerate(decoded_vocab):
        t = bytes(text)
        if t in (b"]", b"}") and t not in found:
            found[t] = i
    return (found[b"]"], found[b"}"]) if len(found) == 2 else None


def token_bitmask(ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """`ids` as one xgrammar bitmask row: int32 [ceil(vocab_size / 32)], bit b of word w
    for token 32 w + b."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    for i in ids:
        if 0 <= i < vocab_size:
            words[i >> 5] |= np.uint32(1 << (i & 31))
    return torch.from_numpy(words.view(np.int32))


def in_window(params: SamplingParams, num_generated: int, window: int) -> bool:
    """Whether a row that has generated `num_generated` tokens samples its next one under
    the closing narrowing (see the module docstring)."""
    g = params.grammar
    return (
        g is not None
        and g.kind in JSON_KINDS
        and not g.think
        and not params.ignore_eos
        and num_generated >= params.min_tokens
        and params.max_tokens - num_generated <= window
    )


class ClosingSet:
    """A vocabulary's closing tokens, those that end a string, and those that are not
    whitespace only, as bitmask rows; the window they apply in."""

    def __init__(
        self,
        bits: torch.Tensor,
        window: int,
        string_bits: torch.Tensor | None = None,
        brackets: tuple[int, int] | None = None,
        blank_bits: torch.Tensor | None = None,
    ) -> None:
        """`bits`, `string_bits`, `blank_bits` (the whitespace-only tokens): int32 [words]
        on the host (`token_bitmask`); `brackets`: the ids of `]` and `}` (`bracket_ids`;
        None: a row is never taken to be in a string)."""
        in_string = bits if string_bits is None or brackets is None else string_bits
        not_blank = ~blank_bits if blank_bits is not None else torch.full_like(bits, -1)
        # Row 0: closing in the structure, row 1: in a string, row 2: not whitespace only.
        self.bits = torch.stack([bits, in_string, not_blank])
        self.window = window
        self.brackets = brackets
        self._on: torch.Tensor | None = None  # `bits` on the masks' device, once asked

    @classmethod
    def of_vocab(
        cls, decoded_vocab: Sequence[bytes], stop_ids: Iterable[int], vocab_size: int, window: int
    ) -> ClosingSet:
        blank = [i for i, text in enumerate(decoded_vocab) if is_blank(bytes(text))]
        return cls(
            token_bitmask(closing_token_ids(decoded_vocab, stop_ids), vocab_size),
            window,
            token_bitmask(string_closing_token_ids(decoded_vocab), vocab_size),
            bracket_ids(decoded_vocab),
            token_bitmask(blank, vocab_size),
        )

    def rows(self, mask_rows: Sequence[int], requests: Sequence[Row]) -> list[int]:
        """The masked rows (`mask_rows`, indices into `requests`) now in their window."""
        window = self.window
        if window <= 0 or not requests:
            return []
        return [
            r for r in mask_rows if in_window(requests[r].params, requests[r].num_generated, window)
        ]

    def narrow(self, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Each of `rows` of `bitmask` (int32 [rows, words], in place) to its closing tokens
        (those that end a string, in a string) where it allows any, else to those that are
        not whitespace only, else unchanged: a few ops on those rows only, no device sync."""
        if not rows:
            return
        dev = bitmask.device
        if self._on is None or self._on.device != dev:
            self._on = self.bits[:, : bitmask.shape[1]].to(dev)
        on = self._on
        idx = torch.tensor(list(rows), dtype=torch.int64, device=dev)
        allowed = bitmask.index_select(0, idx)
        closers = on[0]
        if self.brackets is not None:
            in_string = torch.ones(len(rows), 1, dtype=torch.bool, device=dev)
            for t in self.brackets:
                in_string &= ((allowed[:, t >> 5 : (t >> 5) + 1] >> (t & 31)) & 1).bool()
            closers = torch.where(in_string, on[1], on[0])
        closing = allowed & closers
        progress = allowed & on[2]
        out = torch.where((progress != 0).any(dim=1, keepdim=True), progress, allowed)
        out = torch.where((closing != 0).any(dim=1, keepdim=True), closing, out)
        bitmask.index_copy_(0, idx, out)

    def apply(
        self, bitmask: torch.Tensor, mask_rows: Sequence[int], requests: Sequence[Row]
    ) -> None:
        """Narrow the masked rows of this step that are in their window."""
        self.narrow(bitmask, self.rows(mask_rows, requests))
