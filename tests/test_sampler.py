"""The sampler: greedy, restricted supports, seeded reproducibility, logprobs."""

from __future__ import annotations

import torch

from subway.ipc.messages import SamplingParams
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
