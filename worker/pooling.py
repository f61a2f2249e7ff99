"""Embeddings (`SamplingParams.pooling`): a prompt's final hidden states (after the model's
last norm), pooled, computed at the prefill positions chunk by chunk.

An embedding request is a prefill with one sampled token (`max_tokens` 1): it shares
steps with generation like any prompt, under the same token budget. Rank 0 keeps a
`Pool` per such sequence: "last" keeps the hidden state of the prompt's last position,
"mean" sums every position's as its chunks run (in float32) and divides at the end.
The pooled vector goes into the step's result with the sequence's sampled token, once
(`emit`). The scheduler never serves these prompts from the prefix cache, so every
position runs here; a preempted sequence prefilled again from position 0 starts its sum
again. A "mean" whose positions did not all run, in order, is emitted as None (the
request fails) rather than as a wrong vector.

As with prompt logprobs (`prompt_logprobs.py`), the runner asks `rows(...)` which extra
rows of the step's hidden states it needs (flat batch indices), has the model return
them after the sampled rows, and gives them to `record(...)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from subway.ipc.messages import SamplingParams, SeqStep


class Pool:
    """One sequence's pooled hidden state so far."""

    def __init__(self, mode: str, prompt_len: int) -> None:
        self.mode = mode
        self.prompt_len = prompt_len
        self.total: torch.Tensor | None = None  # "mean": the sum so far; "last": the vector
        self.count = 0  # "mean": positions summed, in order from 0

    def add(self, rows: torch.Tensor, lo: int) -> None:
        rows = rows.float()
        if self.mode == "last":
            self.total, self.count = rows[-1].clone(), self.prompt_len
            return
        if lo == 0:  # the prompt (again, after a preemption) from its start
            self.total, self.count = None, 0
        if lo != self.count:
            self.count = -1  # a gap: this sum is not the prompt's
            return
        s = rows.sum(0)
        self.total = s if self.total is None else self.total + s
        self.count += rows.shape[0]

    def vector(self) -> bytes | None:
        if self.total is None or self.count != self.prompt_len:
            return None
        v = self.total if self.mode == "last" else self.total / self.count
        return v.cpu().numpy().astype("<f4").tobytes()


class PoolingTracker:
    def __init__(self) -> None:
        self.pending: dict[int, Pool] = {}

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def add(self, seq_id: int, sampling: SamplingParams, prompt_len: int) -> None:
        if sampling.pooling:
            self.pending[seq_id] = Pool(sampling.pooling, prompt_len)

    def forget(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.pending.pop(sid, None)

    def rows(
        self, seqs: Sequence[SeqStep], qlens: np.ndarray
    ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Flat batch indices whose hidden states this step needs, and (seq_id, lo, hi) per
        slice: prompt positions lo..hi-1 of that sequence, in that order."""
        starts = np.cumsum(qlens) - qlens
        parts: list[np.ndarray] = []
        slices: list[tuple[int, int, int]] = []
        for i, step in enumerate(seqs):
            pool = self.pending.get(step.seq_id)
            if pool is None:
                continue
            lo = step.start_pos
            hi = min(step.start_pos + step.num_tokens, pool.prompt_len)
            if pool.mode == "last":
                if not lo <= pool.prompt_len - 1 < hi:
                    continue
                lo = pool.prompt_len - 1
            if lo >= hi:
                continue
            first = starts[i] + lo - step.start_pos
            parts.append(np.arange(first, first + hi - lo, dtype=np.int64))
            slices.append((step.seq_id, lo, hi))
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return idx, slices

    def record(self, hidden: torch.Tensor, slices: list[tuple[int, int, int]]) -> None:
        """`hidden [rows, hidden_size]`: the final hidden states of `rows(...)`, in its order."""
        row = 0
        for sid, lo, hi in slices:
            self.pending[sid].add(hidden[row : row + hi - lo], lo)
            row += hi - lo

    def emit(self, sampled_seq_ids: Sequence[int]) -> list[bytes | None] | None:
        """For the sequences that sampled this step: the vectors of those pooled (their one
        sample ends the prefill); None if none of them is."""
        if not any(sid in self.pending for sid in sampled_seq_ids):
            return None
        pending = self.pending
        return [pending.pop(sid).vector() if sid in pending else None for sid in sampled_seq_ids]
