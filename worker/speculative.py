"""Speculative decoding, the worker's side: which rows to sample, and which tokens to keep.

A sequence with a draft `d_1 .. d_k` feeds its last token and the draft at
positions `p .. p + k`; the logits at position `p + j` give the distribution of
the token after `d_j` (after the last token for `j = 0`); attention sees them as
`k + 1` one-token rows with growing contexts (`draft_rows`). The worker samples
every one of those `k + 1` rows as it samples any row (same parameters, the
row's own count of generated tokens for seeds and min_tokens, the draft before
it for penalties), then keeps the sampled tokens up to and including the first
that differs from the draft: `t_0 .. t_j` with `t_i = d_{i+1}` for `i < j`.

This is rejection sampling for a draft that is one token for certain (an
n-gram's): accepting `d` with probability `p(d)` and otherwise drawing from `p`
without `d`, renormalised, is exactly drawing `t ~ p` and comparing it with `d`.
Each kept token is then a draw from the target distribution given the tokens
before it, so sampled output keeps its distribution, and greedy output is
token for token what decoding one token at a time gives.
"""

from __future__ import annotations

import numpy as np


def draft_rows(
    drafts: list[int], qlens: np.ndarray, ctx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's sequences as attention rows: a sequence with a draft of `k` tokens (its one
    own token, then the draft) becomes `k + 1` rows of one query token each, whose contexts
    end at their own positions (causal), so that decode attention serves them as it serves
    any decode, reading the blocks in place; other sequences stay one row. `drafts[i]` is
    sequence i's draft length. Returns per row: query length, context length, its sequence."""
    widths = np.asarray(drafts, dtype=np.int64) + 1
    row_of = np.repeat(np.arange(len(widths)), widths)
    first = np.cumsum(widths) - widths  # each sequence's first row
    j = np.arange(len(row_of)) - first[row_of]  # a row's place within its sequence
    drafted = widths[row_of] > 1
    row_qlens = np.where(drafted, 1, qlens[row_of])
    row_ctx = np.where(drafted, ctx[row_of] - (widths[row_of] - 1) + j, ctx[row_of])
    return row_qlens, row_ctx, row_of


def verify(sampled: list[int], drafts: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """Each sequence's sampled rows (1 + len(draft), in order) against its draft: the
    tokens kept (each sequence's run in turn), how many per sequence, and their rows."""
    tokens: list[int] = []
    counts: list[int] = []
    rows: list[int] = []
    r = 0
    for draft in drafts:
        k = len(draft)
        j = 0
        while j < k and sampled[r + j] == draft[j]:
            j += 1
        tokens += sampled[r : r + j + 1]
        rows += range(r, r + j + 1)
        counts.append(j + 1)
        r += k + 1
    if r != len(sampled):
        raise ValueError(f"{len(sampled)} sampled rows for drafts that need {r}")
    return tokens, counts, rows
