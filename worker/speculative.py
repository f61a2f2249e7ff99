"""Speculative decoding, the worker's side: which rows to sample, and which tokens to keep.

A sequence with a draft `d_1 .. d_k` feeds its last token and the draft at
positions `p .. p + k`; the logits at position `p + j` give the distribution of
the token after `d_j` (after the last token for `j = 0`). The worker samples
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


def sample_rows(ends: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Flat batch indices of the rows to sample: for each sampling sequence, whose inputs
    end at `ends[i]` (exclusive), its last `widths[i]` positions, in order."""
    total = int(widths.sum())
    starts = np.repeat(ends - widths, widths)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(widths) - widths, widths)
    return starts + offsets


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
