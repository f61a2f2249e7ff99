"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of each prompt token
given the ones before it, computed at the prefill positions, chunk by chunk.

Rank 0 keeps an accumulator per sequence that asked, fills it as its prefill
chunks run (position p's logits score prompt token p+1), and hands it over with
the sequence's first sampled token, once. Positions the worker never runs (a
prefix the scheduler found in the prefix cache) stay NaN. A preempted
sequence that is prefilled again overwrites the same entries.

The runner asks `rows(...)` which extra hidden-state rows a step needs (flat
batch indices), computes their logits with the sampling rows, and gives them
to `record(...)`; `emit(...)` goes into the step's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from subway.ipc.messages import PromptLogprobs, SamplingParams, SeqStep
from subway.worker.sampler import prompt_logprobs


class _Acc:
    def __init__(self, k: int, prompt_len: int) -> None:
        self.k = k
        self.prompt_len = prompt_len
        n = max(0, prompt_len - 1)
        self.logprobs = [math.nan] * n
        self.top_ids: list[list[int]] = [[] for _ in range(n)]
        self.top_logprobs: list[list[float]] = [[] for _ in range(n)]

    def message(self) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs, self.top_ids, self.top_logprobs)


class PromptLogprobTracker:
    def __init__(self) -> None:
        self.pending: dict[int, _Acc] = {}

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def add(self, seq_id: int, sampling: SamplingParams, prompt_len: int) -> None:
        if sampling.prompt_logprobs is not None:
            self.pending[seq_id] = _Acc(max(0, sampling.prompt_logprobs), prompt_len)

    def forget(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.pending.pop(sid, None)

    def rows(
        self, seqs: Sequence[SeqStep], qlens: np.ndarray
    ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Flat batch indices whose logits this step needs, and (seq_id, lo, hi) per slice:
        positions lo..hi-1 of that sequence's prompt, in that order."""
        starts = np.cumsum(qlens) - qlens
        parts: list[np.ndarray] = []
        slices: list[tuple[int, int, int]] = []
        for i, step in enumerate(seqs):
            acc = self.pending.get(step.seq_id)
            if acc is None:
                continue
            lo = step.start_pos
            hi = min(step.start_pos + step.num_tokens, acc.prompt_len - 1)
            if lo >= hi:
                continue
            parts.append(np.arange(starts[i], starts[i] + hi - lo, dtype=np.int64))
            slices.append((step.seq_id, lo, hi))
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return idx, slices

    def record(
        self,
        logits: torch.Tensor,
        slices: list[tuple[int, int, int]],
        tokens_of: Callable[[int], list[int]],
    ) -> None:
        """`logits [rows, vocab]`: the rows of `rows(...)`, in its order."""
        if not slices:
            return
        targets: list[int] = []
        for sid, lo, hi in slices:
            targets += tokens_of(sid)[lo + 1 : hi + 1]
        k = max(self.pending[sid].k for sid, _, _ in slices)
        target_t = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        chosen, top_ids, top_lps = prompt_logprobs(logits, target_t, k)
        row = 0
        for sid, lo, hi in slices:
            acc = self.pending[sid]
            n = hi - lo
            acc.logprobs[lo:hi] = chosen[row : row + n]
            acc.top_ids[lo:hi] = [ids[: acc.k] for ids in top_ids[row : row + n]]
            acc.top_logprobs[lo:hi] = [v[: acc.k] for v in top_lps[row : row + n]]
            row += n

    def emit(self, sampled_seq_ids: Sequence[int]) -> list[PromptLogprobs | None] | None:
        """For the sequences that sampled this step: the prompt logprobs of those that asked
        (their first sample); None if there are none."""
        if not self.pending:
            return None
        out: list[PromptLogprobs | None] = []
        for sid in sampled_seq_ids:
            acc = self.pending.pop(sid, None)
            out.append(acc.message() if acc is not None else None)
        return out if any(x is not None for x in out) else None
