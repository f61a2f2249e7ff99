"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds, logprobs,
and the constraints: a grammar's mask, logit_bias, min_tokens.

Every step works on the whole batch at once: per-row parameters become
columns (one tensor each) and no torch operation runs per row. The order:
raw logits (float32) -> grammar mask, logit_bias, min_tokens -> penalties ->
temperature, top-k, top-p, min-p -> sample. A batch that is all greedy with
none of the others takes a fast path (an argmax); a greedy batch with a
constraint takes the argmax of its constrained scores. Sampling is the
exponential race (`argmax(p / E)`, `E ~ Exp(1)`), which draws exactly from `p`
with one noise tensor per row.

A seeded request's noise is a counter-based hash of (seed, number of tokens
generated so far, vocabulary index) computed on the device: its tokens do not
depend on what else is in the batch, nor on whether it was preempted and
recomputed. Unseeded requests share one generator.

Logprobs are those of the raw logits (before the constraints, penalties,
temperature and truncation), as vLLM reports them by default; prompt logprobs likewise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from subway.ipc.messages import SamplingParams

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_STREAM = _i64(0xD1B54A32D192ED03)  # a second odd constant: spreads vocabulary indices


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


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps, as uint64 would)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_exponential(
    seeds: torch.Tensor, counters: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exp(1) noise `[rows, vocab]`, each row a pure function of (seed, counter): batch-free."""
    keys = _mix64(seeds * _GOLDEN + counters + 1)  # [rows]
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device) * _STREAM
    bits = _mix64(keys[:, None] ^ cols[None, :])
    # 24 high bits -> a uniform in (0, 1), never 0 nor 1. The top one, 1 - 2^-25, rounds to
    # 1.0 in float32, whose noise -log(1) = -0 made the race divide 0 by 0 (2^-24 of the
    # entries: a masked token, its probability 0, came out NaN and won the argmax): held
    # at float32's largest value below 1.
    u = ((_shr(bits, 40).to(dtype) + 0.5) * (1.0 / (1 << 24))).clamp_(max=1.0 - 2.0**-24)
    return -torch.log(u)


class LogitMask(Protocol):
    """Allowed tokens of some rows (`rows`); `apply` sets the others to -inf, in place;
    `requests` (the batch's rows) tell a row's progress, for a mask that depends on it
    (a JSON's closing window, `json_budget.py`)."""

    rows: list[int]

    def apply(self, scores: torch.Tensor, requests: Sequence[SampleRequest] = ()) -> None: ...


def has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)  # what min_tokens holds back (unless ignore_eos)
        # The greedy fast path on bfloat16 CPU logits, without widening them (a kernel).
        self.argmax_rows = argmax_rows

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRequest], mask: LogitMask | None = None
    ) -> SamplerOutput:
        """Sample one token per row; `mask` (a grammar's, rank 0) limits some rows' tokens."""
        params = [r.params for r in rows]
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        adjusted = any(r.params.logit_bias or r.num_generated < r.params.min_tokens for r in rows)
        want_logprobs = any(p.logprobs is not None for p in params)
        fast = all(greedy) and not penalised and not adjusted and mask is None
        if (
            fast
            and not want_logprobs
            and self.argmax_rows is not None
            and logits.dtype == torch.bfloat16
            and logits.device.type == "cpu"
        ):  # the same first index of the largest value, without the float32 copy
            return SamplerOutput(tokens=self.argmax_rows(logits))
        # In float32, as transformers does (and the CPU's bfloat16 argmax is a slow scalar loop).
        raw = logits.float()
        if fast:
            tokens = raw.argmax(dim=-1)
        else:
            # In place on a float copy nobody else reads; else on a clone (logprobs read raw).
            own = raw is not logits and not want_logprobs
            scores = self._constrain(raw, rows, mask, adjusted, own)
            if penalised:
                scores = self._apply_penalties(scores, rows, penalised)
            tokens = self._sample(scores, rows, params, greedy)
        out = SamplerOutput(tokens=tokens)
        if want_logprobs:
            self._logprobs(raw, tokens, params, out)
        return out

    def _constrain(
        self,
        raw: torch.Tensor,
        rows: list[SampleRequest],
        mask: LogitMask | None,
        adjusted: bool,
        own: bool,
    ) -> torch.Tensor:
        """The grammar mask, logit_bias and min_tokens, batch-wide: on `raw` in place if
        `own`, else on a copy; `raw` itself when none applies."""
        bias = self._bias_entries(rows, raw.device) if adjusted else None
        held = self._held_back(rows) if adjusted else None
        if mask is None and bias is None and held is None:
            return raw
        scores = raw if own else raw.clone()
        if mask is not None:
            mask.apply(scores, rows)
        if bias is not None:
            scores.index_put_(bias[0], bias[1], accumulate=True)
        if held is not None:
            self._hold_back(scores, held, mask)
        return scores

    @staticmethod
    def _bias_entries(
        rows: list[SampleRequest], dev: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """logit_bias of every row as flat (row, id) indices and values, or None."""
        row_of: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i, r in enumerate(rows):
            bias = r.params.logit_bias
            if bias:
                row_of += [i] * len(bias)
                ids += bias.keys()
                values += bias.values()
        if not ids:
            return None
        index = (torch.tensor(row_of, device=dev), torch.tensor(ids, device=dev))
        return index, torch.tensor(values, dtype=torch.float32, device=dev)

    def _held_back(self, rows: list[SampleRequest]) -> tuple[list[int], list[int]] | None:
        """(rows, ids) that min_tokens keeps from being sampled yet: the stop ids, and EOS
        unless ignore_eos, of every row with fewer than min_tokens tokens generated."""
        row_of: list[int] = []
        ids: list[int] = []
        eos = self.eos_token_ids
        for i, r in enumerate(rows):
            p = r.params
            if r.num_generated < p.min_tokens:
                held = p.stop_token_ids if p.ignore_eos else [*eos, *p.stop_token_ids]
                row_of += [i] * len(held)
                ids += held
        return (row_of, ids) if ids else None

    def _hold_back(
        self, scores: torch.Tensor, held: tuple[list[int], list[int]], mask: LogitMask | None
    ) -> None:
        """min_tokens: the held-back ids to -inf, in place. A row whose grammar allows
        nothing else (it must end now) keeps its grammar's choice: the grammar wins."""
        dev = scores.device
        index = (torch.tensor(held[0], device=dev), torch.tensor(held[1], device=dev))
        minus_inf = torch.tensor(float("-inf"), device=dev)
        both = sorted(set(held[0]).intersection(mask.rows)) if mask is not None else []
        if not both:
            scores.index_put_(index, minus_inf)
            return
        which = torch.tensor(both, device=dev)
        before = scores.index_select(0, which)
        scores.index_put_(index, minus_inf)
        after = scores.index_select(0, which)
        nothing_left = torch.isneginf(after).all(dim=-1, keepdim=True)
        scores.index_copy_(0, which, torch.where(nothing_left, before, after))

    # ------------------------------------------------------------------ pieces

    def _sample(
        self,
        scores: torch.Tensor,
        rows: list[SampleRequest],
        params: list[SamplingParams],
        greedy_list: list[bool],
    ) -> torch.Tensor:
        dev = scores.device
        argmax = scores.argmax(dim=-1)
        if all(greedy_list):
            return argmax
        greedy = torch.tensor(greedy_list, device=dev)
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy_list, params, strict=True)],
            device=dev,
        )
        scores = scores / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # Mask in sorted order, then back to vocab order: a row's noise must not depend
            # on whether another row of the batch needed sorting.
            sorted_scores, idx = scores.sort(dim=-1, descending=True, stable=True)
            scores = scores.scatter(1, idx, _top_k_top_p(sorted_scores, params))
        probs = scores.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            cutoff = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            probs = probs.masked_fill(probs < cutoff, 0.0)
        choice = (probs / self._noise(probs, rows, params, greedy_list)).argmax(dim=-1)
        return torch.where(greedy, argmax, choice)

    def _noise(
        self,
        probs: torch.Tensor,
        rows: list[SampleRequest],
        params: list[SamplingParams],
        greedy: list[bool],
    ) -> torch.Tensor:
        """Exp(1) noise, `[rows, vocab]`: seeded rows from their hash, the others shared."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        seeded = [
            i
            for i, (p, g) in enumerate(zip(params, greedy, strict=True))
            if p.seed is not None and not g
        ]
        if seeded:
            dev = probs.device
            seeds = torch.tensor([_i64(params[i].seed) for i in seeded], device=dev)
            counters = torch.tensor([rows[i].num_generated for i in seeded], device=dev)
            which = torch.tensor(seeded, device=dev)
            own = seeded_exponential(seeds, counters, probs.shape[1], probs.dtype)
            noise = noise.index_copy(0, which, own)
        return noise

    @staticmethod
    def _apply_penalties(
        scores: torch.Tensor, rows: list[SampleRequest], which: list[int]
    ) -> torch.Tensor:
        """vLLM's semantics: repetition over prompt and output, presence/frequency over output.

        All penalised rows at once: their tokens go in one flat tensor with row indices."""
        dev = scores.device
        vocab = scores.shape[1]
        sub = [rows[i] for i in which]
        lengths = np.fromiter((len(r.tokens) for r in sub), dtype=np.int64, count=len(sub))
        total = int(lengths.sum())
        flat = np.fromiter(
            itertools.chain.from_iterable(r.tokens for r in sub), dtype=np.int64, count=total
        )
        starts = np.cumsum(lengths) - lengths
        prompt_lens = np.fromiter((r.prompt_len for r in sub), dtype=np.int64, count=len(sub))
        row_of = np.repeat(np.arange(len(sub)), lengths)
        is_output = (np.arange(total) - np.repeat(starts, lengths)) >= np.repeat(
            prompt_lens, lengths
        )
        ids = torch.from_numpy(flat).to(dev)
        row_t = torch.from_numpy(row_of).to(dev)
        out_t = torch.from_numpy(is_output).to(dev)
        params = [r.params for r in sub]
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        idx = torch.tensor(which, device=dev)

        seen = torch.zeros(len(sub), vocab, dtype=torch.bool, device=dev)
        seen[row_t, ids] = True
        counts = torch.zeros(len(sub), vocab, dtype=scores.dtype, device=dev)
        counts.index_put_(
            (row_t[out_t], ids[out_t]),
            torch.ones(int(out_t.sum()), dtype=scores.dtype, device=dev),
            accumulate=True,
        )
        s = scores.index_select(0, idx)
        s = torch.where(seen, torch.where(s > 0, s / rep, s * rep), s)
        s = s - freq * counts - pres * (counts > 0).to(s.dtype)
        return scores.index_copy(0, idx, s)

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


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Logprob of each target (the next prompt token) under its position's raw logits,
    with the top `k` alternatives: `logits [P, vocab]`, `targets [P]`."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    if k <= 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    values, ids = lp.topk(k, dim=-1)
    return chosen, ids.tolist(), values.tolist()


def _top_k_top_p(sorted_scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the sorted scores outside each row's top-k and nucleus top-p."""
    vocab = sorted_scores.shape[1]
    rank = torch.arange(vocab, device=sorted_scores.device)[None, :]
    k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=sorted_scores.device
    )
    sorted_scores = sorted_scores.masked_fill(rank >= k[:, None], float("-inf"))
    if any(p.top_p < 1.0 for p in params):  # decided on the host: no device sync
        top_p = torch.tensor([p.top_p for p in params], device=sorted_scores.device)
        probs = sorted_scores.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        outside = (before >= top_p[:, None]) & (rank > 0)
        sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
    return sorted_scores
