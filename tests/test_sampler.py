"""The sampler: greedy, restricted supports, seeded reproducibility, logprobs, and the
constraints (a grammar's mask, logit_bias, min_tokens)."""

from __future__ import annotations

import math

import numpy as np
import torch

from subway.ipc.messages import SamplingParams
from subway.worker.grammar import TokenMask
from subway.worker.sampler import Sampler, SampleRequest

# probabilities 0.5, 0.3, 0.1, 0.05, 0.05 (and a long tail of nothing)
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = PROBS.log()


def _rows(params: SamplingParams, n: int, generated: int = 0) -> list[SampleRequest]:
    return [SampleRequest(params, generated, [0, 1], 2) for _ in range(n)]


def _support(params: SamplingParams, n: int = 2000) -> set[int]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    return set(sampler(LOGITS.repeat(n, 1), _rows(params, n)).tokens.tolist())


def test_greedy_fast_path_and_mixed():
    logits = torch.randn(6, 50)
    sampler = Sampler(torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0)
    out = sampler(logits, _rows(greedy, 6))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None
    hot = SamplingParams(temperature=5.0)
    rows = [SampleRequest(greedy if i % 2 else hot, 0, [], 0) for i in range(6)]
    tokens = sampler(logits, rows).tokens
    assert tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def test_plain_sampling_follows_the_distribution():
    n = 6000
    tokens = Sampler(torch.device("cpu"), seed=3)(
        LOGITS.repeat(n, 1), _rows(SamplingParams(), n)
    ).tokens
    freq = torch.bincount(tokens, minlength=5).float() / n
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_top_k_top_p_min_p_restrict_the_support():
    assert _support(SamplingParams()) == {0, 1, 2, 3, 4}
    assert _support(SamplingParams(top_k=2)) == {0, 1}
    assert _support(SamplingParams(top_k=1)) == {0}
    assert _support(SamplingParams(top_p=0.75)) == {0, 1}
    assert _support(SamplingParams(top_p=0.85)) == {0, 1, 2}
    assert _support(SamplingParams(min_p=0.25)) == {0, 1}  # cutoff 0.125
    assert _support(SamplingParams(min_p=0.15)) == {0, 1, 2}
    assert _support(SamplingParams(top_k=3, top_p=0.6)) == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=0.7, top_k=50)
    alone = Sampler(torch.device("cpu"), seed=1)(logits[:1], [SampleRequest(seeded, 5, [], 0)])
    mixed_rows = [
        SampleRequest(other, 0, [], 0),
        SampleRequest(SamplingParams(seed=7), 3, [], 0),
        SampleRequest(seeded, 5, [], 0),
        SampleRequest(SamplingParams(temperature=0.0), 0, [], 0),
    ]
    batch = torch.stack([logits[1], logits[2], logits[0], logits[3]])
    mixed = Sampler(torch.device("cpu"), seed=99)(batch, mixed_rows)
    assert mixed.tokens[2] == alone.tokens[0]
    # the draw depends on how many tokens were generated, not on the step or the batch
    draws = {
        int(Sampler(torch.device("cpu"))(logits[:1], [SampleRequest(seeded, g, [], 0)]).tokens[0])
        for g in range(20)
    }
    assert len(draws) > 5


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, logprobs=0),
        SamplingParams(temperature=1.3, repetition_penalty=1.5, logprobs=5),
    ]
    rows = [SampleRequest(p, 1, [1, 2, 3], 2) for p in params]
    out = Sampler(torch.device("cpu"))(logits, rows)
    ref = logits.log_softmax(-1)
    for i, tok in enumerate(out.tokens.tolist()):
        assert abs(out.logprobs[i] - float(ref[i, tok])) < 1e-5
        n = params[i].logprobs
        top = ref[i].topk(n) if n else None
        assert out.top_ids[i] == (top.indices.tolist() if n else [])
        if n:
            torch.testing.assert_close(torch.tensor(out.top_logprobs[i]), top.values)
    assert out.tokens[0] == logits[0].argmax()
    assert out.tokens[1] in logits[1].topk(5).indices.tolist()


def test_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    sampler = Sampler(torch.device("cpu"))
    # token 0 was generated: a presence penalty makes greedy pick token 1
    row = SampleRequest(SamplingParams(temperature=0.0, presence_penalty=0.5), 1, [2, 0], 1)
    assert sampler(logits, [row]).tokens.tolist() == [1]
    # repetition penalty counts the prompt too
    row = SampleRequest(SamplingParams(temperature=0.0, repetition_penalty=2.0), 0, [0], 1)
    assert sampler(logits, [row]).tokens.tolist() == [1]
    # frequency penalty scales with the count
    row = SampleRequest(SamplingParams(temperature=0.0, frequency_penalty=0.05), 3, [1, 0, 0, 0], 1)
    assert sampler(logits, [row]).tokens.tolist() == [1]


# ---------------------------------------------------------------- constraints

EOS = 7


def _bitmask(allowed: dict[int, list[int]], rows: int, vocab: int) -> TokenMask:
    """A grammar's mask by hand: row r may sample only `allowed[r]`; other rows unmasked."""
    bits = np.zeros((rows, -(-vocab // 32)), dtype=np.uint32)
    for r, ids in allowed.items():
        for t in ids:
            bits[r, t // 32] |= np.uint32(1 << (t % 32))
    return TokenMask(torch.from_numpy(bits.view(np.int32)), sorted(allowed))


def test_logit_bias_forces_and_forbids_and_logprobs_stay_raw():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen)
    top = logits.argmax(-1).tolist()
    rows = [
        SampleRequest(
            SamplingParams(temperature=0.0, logit_bias={123: 100.0}, logprobs=2), 0, [], 0
        ),
        SampleRequest(SamplingParams(temperature=0.0, logit_bias={top[1]: -100.0}), 0, [], 0),
        SampleRequest(SamplingParams(temperature=0.0, logprobs=1), 0, [], 0),
        SampleRequest(SamplingParams(temperature=1.0, seed=4, logit_bias={9: 100.0}), 0, [], 0),
    ]
    out = Sampler(torch.device("cpu"))(logits, rows)
    assert out.tokens.tolist()[:3] == [123, logits[1].topk(2).indices[1].item(), top[2]]
    assert out.tokens[3] == 9  # sampled, seeded: the bias still decides
    raw = logits.log_softmax(-1)
    assert abs(out.logprobs[0] - float(raw[0, 123])) < 1e-5  # the raw logprob of the forced id
    assert out.top_ids[0] == raw[0].topk(2).indices.tolist()


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.full((1, 20), -5.0)
    logits[0, EOS], logits[0, 11], logits[0, 3] = 9.0, 8.0, 1.0  # EOS, then stop id 11, then 3
    sampler = Sampler(torch.device("cpu"), eos_token_ids=[EOS, 19])

    def pick(generated: int, **kw) -> int:
        p = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[11], **kw)
        return int(sampler(logits, [SampleRequest(p, generated, [], 0)]).tokens[0])

    assert [pick(g) for g in (0, 3, 4, 9)] == [3, 3, EOS, EOS]
    assert [pick(g, ignore_eos=True) for g in (0, 4)] == [EOS, EOS]  # EOS free; stop id held
    logits[0, EOS] = -5.0
    assert [pick(g, ignore_eos=True) for g in (0, 4)] == [3, 11]
    # sampled rows too: never EOS nor a stop id before min_tokens
    hot = SamplingParams(temperature=2.0, min_tokens=1, stop_token_ids=[11])
    many = sampler(logits.repeat(500, 1), [SampleRequest(hot, 0, [], 0)] * 500).tokens
    assert not set(many.tolist()) & {EOS, 19, 11}


def test_grammar_mask_limits_its_rows_and_leaves_the_others_bit_identical():
    vocab = 70
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=20),
        SamplingParams(temperature=0.7, seed=3),
    ]
    rows = [SampleRequest(p, 2, [1, 2, 3], 1) for p in params]
    allowed = {0: [40, 41], 1: [1, 33, 64], 4: [5]}
    spread = set()
    for seed in range(30):  # a generator in the same state for both: the same draws
        plain = Sampler(torch.device("cpu"), seed=seed)(logits, rows).tokens.tolist()
        sampler = Sampler(torch.device("cpu"), seed=seed)
        t = sampler(logits, rows, _bitmask(allowed, 8, vocab)).tokens.tolist()
        assert t[0] == 40 + int(logits[0, 41] > logits[0, 40])  # greedy: the masked argmax
        assert t[1] in (1, 33, 64) and t[4] == 5
        assert t[2] == plain[2] and t[3] == plain[3]  # unconstrained rows: unchanged
        spread.add(t[3])
    assert len(spread) > 1  # and the unconstrained sampled row did sample


def test_a_grammar_that_must_end_wins_over_min_tokens():
    vocab = 40
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.0, min_tokens=5, logprobs=0)
    rows = [SampleRequest(p, 0, [], 0), SampleRequest(p, 0, [], 0)]
    mask = _bitmask({0: [EOS], 1: [EOS, 30]}, 2, vocab)
    out = Sampler(torch.device("cpu"), eos_token_ids=[EOS])(logits, rows, mask)
    assert out.tokens.tolist() == [EOS, 30]  # row 0 may only end; row 1 may go on
    assert all(math.isfinite(x) for x in out.logprobs)
