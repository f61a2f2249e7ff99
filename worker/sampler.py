"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds, logprobs.

A seeded request draws its noise from a generator seeded by (seed, number of
tokens generated so far), so its tokens do not depend on what else is in the
batch, nor on whether it was preempted and recomputed. Unseeded requests share
one generator. Sampling is the exponential race (`argmax(p / E)`, `E ~ Exp(1)`),
which draws exactly from `p` with one noise tensor per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from subway.ipc.messages import SamplingParams

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SampleRequest:
    """One row of the logits: its parameters and what seeds and penalties need."""

    params: SamplingParams
    num_generated: int  # tokens generated before this one
    tokens: list[int]  # prompt + generated so far (read only for penalties)
    prompt_len: int


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] int64
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def seed_for(seed: int, num_generated: int) -> int:
    """A well-mixed 64-bit generator seed for token `num_generated` of a request (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_EPS


def has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
        params = [r.params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if all(is_greedy(p) for p in params) and not penalised and not want_logprobs:
            return SamplerOutput(tokens=logits.argmax(dim=-1))
        raw = logits.float()
        scores = self._apply_penalties(raw, rows, penalised) if penalised else raw
        tokens = self._sample(scores, rows)
        out = SamplerOutput(tokens=tokens)
        if want_logprobs:
            self._logprobs(raw, tokens, params, out)
        return out

    # ------------------------------------------------------------------ pieces

    def _sample(self, scores: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        params = [r.params for r in rows]
        greedy = torch.tensor([is_greedy(p) for p in params], device=scores.device)
        argmax = scores.argmax(dim=-1)
        if bool(greedy.all()):
            return argmax
        temps = torch.tensor(
            [1.0 if is_greedy(p) else p.temperature for p in params], device=scores.device
        )
        scores = scores / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # Mask in sorted order, then back to vocab order: a row's noise must not depend
            # on whether another row of the batch needed sorting.
            sorted_scores, idx = scores.sort(dim=-1, descending=True, stable=True)
            scores = scores.scatter(1, idx, _top_k_top_p(sorted_scores, params))
        probs = scores.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=scores.device)
            cutoff = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            probs = probs.masked_fill(probs < cutoff, 0.0)
        choice = (probs / self._noise(probs, rows)).argmax(dim=-1)
        return torch.where(greedy, argmax, choice)

    def _noise(self, probs: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """Exp(1) noise, `[rows, vocab]`: seeded rows from their own generator, others shared."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None and not is_greedy(r.params):
                g = torch.Generator(device=probs.device)
                g.manual_seed(seed_for(r.params.seed, r.num_generated))
                noise[i].exponential_(generator=g)
        return noise

    @staticmethod
    def _apply_penalties(
        scores: torch.Tensor, rows: list[SampleRequest], which: list[int]
    ) -> torch.Tensor:
        """vLLM's semantics: repetition over prompt and output, presence/frequency over output."""
        scores = scores.clone()
        vocab = scores.shape[1]
        for i in which:
            r, p = rows[i], rows[i].params
            ids = torch.tensor(r.tokens, dtype=torch.int64, device=scores.device)
            row = scores[i]
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
                seen[ids] = True
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row = torch.where(seen, penalised, row)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                counts = torch.bincount(ids[r.prompt_len :], minlength=vocab).to(row.dtype)
                row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
            scores[i] = row
        return scores

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], out: SamplerOutput
    ) -> None:
        """Logprob of each sampled token and the top-N, from the raw (unprocessed) logits."""
        lp = raw.log_softmax(dim=-1)
        out.logprobs = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
        n = max((p.logprobs or 0) for p in params)
        if n == 0:
            out.top_ids = [[] for _ in params]
            out.top_logprobs = [[] for _ in params]
            return
        values, ids = lp.topk(n, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        out.top_ids = [row[: p.logprobs or 0] for row, p in zip(ids, params, strict=True)]
        out.top_logprobs = [row[: p.logprobs or 0] for row, p in zip(values, params, strict=True)]


def _top_k_top_p(sorted_scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the sorted scores outside each row's top-k and nucleus top-p."""
    vocab = sorted_scores.shape[1]
    rank = torch.arange(vocab, device=sorted_scores.device)[None, :]
    k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=sorted_scores.device
    )
    sorted_scores = sorted_scores.masked_fill(rank >= k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=sorted_scores.device)
    if bool((top_p < 1.0).any()):
        probs = sorted_scores.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        outside = (before >= top_p[:, None]) & (rank > 0)
        sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
    return sorted_scores
