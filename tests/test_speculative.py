"""Speculative decoding (n-gram prompt lookup): the config, the proposer, verification, the
scheduler under it (property tests with the fake worker), and the model path, whose greedy
output must equal transformers' token for token and whose seeded samples must equal those
decoded one token at a time."""

from __future__ import annotations

import json
import random
import time
import zlib
from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import VOCAB, FakeWorker, Req, drive, make_scheduler, reference
from test_scheduler_props import workloads

from subway import LLM
from subway.ipc.messages import Grammar, Plan, SamplingParams, SeqStep, StepResult, TokenRef
from subway.scheduler.speculative import SpeculativeConfig, SpeculativeConfigError, propose
from subway.scheduler.worker_link import check_result
from subway.worker.speculative import draft_rows, verify

import reference as hf

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
    '"disable_by_batch_size": 8}'
)


def ids(*xs: int) -> array:
    return array("i", xs)


# ------------------------------------------------------------------ config and proposer


def test_config_is_vllms_spelling_and_bad_ones_are_refused():
    assert SpeculativeConfig.parse("") is None
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    assert cfg.disable_by_batch_size == 8
    for bad, says in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "not supported"),
        ('{"draft_model": "x"}', "unknown field"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 2.5}', "integer"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size"),
    ]:
        with pytest.raises(SpeculativeConfigError, match=says):
            SpeculativeConfig.parse(bad)


def test_the_server_refuses_a_bad_config_before_starting():
    from subway.tools.cli import main

    with pytest.raises(SystemExit, match="not supported"):
        main(["serve", "--speculative-config", '{"method": "medusa"}'])


def test_propose_takes_what_followed_the_most_recent_longest_match():
    # ... 1 2 3 [7 8] ... 1 2 3 [9 5 6] ... 1 2 3 -> the later match wins: 9 5 6 ...
    seq = ids(4, 1, 2, 3, 7, 8, 0, 1, 2, 3, 9, 5, 6, 0, 1, 2, 3)
    assert propose(seq, ids(), 3, 3, 1) == [9, 5, 6]
    assert propose(seq, ids(), 1, 3, 1) == [9]
    # The draft stops at the end of the sequence.
    assert propose(ids(5, 6, 7, 5, 6), ids(), 4, 2, 1) == [7, 5, 6]
    # Output counts as much as the prompt.
    assert propose(ids(5, 6), ids(7, 5, 6), 4, 2, 1) == [7, 5, 6]
    # The longest n that occurs, not the first found: 2 3 occurs (-> 8), 3 alone later (-> 1).
    assert propose(ids(2, 3, 8, 3, 1, 2, 3), ids(), 1, 2, 1) == [8]
    assert propose(ids(2, 3, 8, 3, 1, 2, 3), ids(), 1, 1, 1) == [1]
    # prompt_lookup_min: a shorter match does not count.
    assert propose(ids(9, 3, 8, 1, 2, 3), ids(), 2, 3, 2) == []
    # No match, or nothing to look up.
    assert propose(ids(1, 2, 3, 4), ids(), 4, 3, 1) == []
    assert propose(ids(1), ids(), 4, 3, 1) == []
    assert propose(ids(1, 1), ids(), 0, 3, 1) == []


def test_propose_matches_whole_tokens_only():
    # The tail token a = 256 has the bytes 00 01 00 00. An aligned match sits at token 0;
    # a later, unaligned one spans t1's last two bytes (00 01) and t2's first two (00 00).
    # A byte search that ignored alignment would take that later one.
    a = 1 << 8
    t1 = 9 + (1 << 24)  # bytes 09 00 00 01
    t2 = 7 << 16  # bytes 00 00 07 00
    seq = ids(a, 42, t1, t2, 99, a)
    assert bytes(seq)[10:14] == bytes(ids(a))  # the unaligned occurrence is there
    assert propose(seq, ids(), 2, 1, 1) == [42, t1]


def test_propose_searches_the_last_window_only():
    from subway.scheduler import speculative

    window = getattr(speculative, "LOOKUP_WINDOW", 8192)  # (the test fails before it was)
    # The only earlier 7 sits at the window's first token, then just outside it.
    inside = ids(7, 8, *([1] * (window - 3)), 7)
    assert len(inside) == window and propose(inside, ids(), 2, 1, 1) == [8, 1]
    assert propose(ids(0, *inside), ids(), 2, 1, 1) == [8, 1]
    outside = ids(7, 8, 9, *inside[2:])  # window + 1 tokens: the first 7 is out
    assert propose(outside, ids(), 2, 1, 1) == []
    # Prompt and output together make the window.
    assert propose(inside[:10], inside[10:], 2, 1, 1) == [8, 1]
    assert propose(outside[:3], outside[3:], 2, 1, 1) == []


def _best_seconds(fn, times: int = 5) -> float:
    best = float("inf")
    for _ in range(times):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_a_proposal_costs_the_same_however_long_the_sequence():
    """1M tokens chosen to match the last one across every token boundary (7 << 8 holds the
    bytes of 7 shifted by one): the byte search over the whole sequence took ~0.35 s a step
    here; the window makes it cost about what 1,000 tokens cost."""
    adversarial = array("i", [7 << 8] * 1_000_000 + [7])
    short = array("i", [7 << 8] * 1_000 + [7])
    assert propose(adversarial, ids(), 4, 4, 1) == []
    long_s = _best_seconds(lambda: propose(adversarial, ids(), 4, 4, 1))
    short_s = _best_seconds(lambda: propose(short, ids(), 4, 4, 1))
    assert long_s < max(5e-3, 20 * short_s), (long_s, short_s)
    # Every token the same, the longest lookup vLLM allows: still bounded.
    same = array("i", [5] * 1_000_000)
    assert propose(same, same, 4, 64, 1) == [5]
    assert _best_seconds(lambda: propose(same, same, 4, 64, 1)) < 0.05


# ------------------------------------------------------------------ verification


def test_verify_keeps_the_matching_run_and_the_next_sampled_token():
    drafts = [[5, 6, 7], [], [1, 2], [3]]
    sampled = [5, 6, 9, 0] + [4] + [8, 2, 2] + [3, 3]
    tokens, counts, rows = verify(sampled, drafts)
    assert counts == [3, 1, 1, 2]
    assert tokens == [5, 6, 9, 4, 8, 3, 3]
    assert rows == [0, 1, 2, 4, 5, 8, 9]
    with pytest.raises(ValueError):
        verify(sampled[:-1], drafts)


def test_draft_rows_are_one_token_rows_with_growing_contexts():
    # A prefill chunk of 5 ending at 9, a decode at 12, a decode with a draft of 3 ending at
    # 20 (its own token at position 16, the draft at 17..19), a plain decode at 4.
    qlens = np.array([5, 1, 4, 1])
    ctx = np.array([9, 12, 20, 4])
    row_qlens, row_ctx, row_of = draft_rows([0, 0, 3, 0], qlens, ctx)
    assert row_qlens.tolist() == [5, 1, 1, 1, 1, 1, 1]
    assert row_ctx.tolist() == [9, 12, 17, 18, 19, 20, 4]
    assert row_of.tolist() == [0, 1, 2, 2, 2, 2, 3]
    assert row_qlens.sum() == qlens.sum()  # the same tokens, in the same order


# ------------------------------------------------------------------ the scheduler


def cyclic_sample(tokens: list[int]) -> int:
    """Mostly a repeat of the token three back (n-gram lookup guesses it), sometimes not
    (a rejection): a deterministic stand-in for a model, for the fake worker."""
    h = zlib.crc32(array("i", tokens))
    if len(tokens) >= 3 and h % 5:
        return tokens[-3]
    return h % VOCAB


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 8),
)
def test_properties_with_speculation(work, k, lookup_max, lookup_min, by_batch):
    """The scheduler's property test (test_scheduler_props) with drafts: every output is
    the request generated alone, one token at a time; blocks, KV and budgets hold."""
    reqs, policy, cfg, overlap = work
    spec = dict(
        num_speculative_tokens=k,
        prompt_lookup_max=max(lookup_max, lookup_min),
        prompt_lookup_min=lookup_min,
        disable_by_batch_size=by_batch,
    )
    sched = make_scheduler(policy=policy, speculative_config=json.dumps(spec), **cfg)
    bm = sched.block_manager
    worker = FakeWorker(bm.num_blocks, bm.block_size, cyclic_sample)
    outs = drive(sched, reqs, overlap, worker)
    for r in reqs:
        o = outs[r.request_id]
        if o.finish_reason in ("stop", "length") and o.token_ids:
            ref = reference(r, sched.max_model_len, cyclic_sample)
            assert (o.token_ids, o.finish_reason) == (ref.token_ids, ref.finish_reason)
    stats = sched.engine_stats()
    assert stats.spec_draft_tokens_total <= worker.num_drafted
    assert stats.spec_accepted_tokens_total <= worker.num_accepted


def _repetitive_reqs(n: int, max_tokens: int = 40) -> list[Req]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(3)] * 3
        out.append(Req(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_drafts_are_accepted_and_rejected_and_counted(overlap):
    reqs = _repetitive_reqs(3)
    plain = make_scheduler()
    base = drive(plain, reqs, overlap, FakeWorker(256, 4, cyclic_sample))
    sched = make_scheduler(speculative_config=NGRAM)
    worker = FakeWorker(256, 4, cyclic_sample)
    outs = drive(sched, reqs, overlap, worker)
    assert {r: o.token_ids for r, o in outs.items()} == {r: o.token_ids for r, o in base.items()}
    s = sched.engine_stats()
    # Every verified draft token is counted; some were accepted, some not.
    assert s.spec_draft_tokens_total == worker.num_drafted
    assert s.spec_accepted_tokens_total == worker.num_accepted
    assert 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    assert s.spec_num_drafts_total > 0
    # Accepted drafts save steps: fewer than one per token.
    assert worker.num_steps < plain.engine_stats().num_steps_total


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    spec = '{"num_speculative_tokens": 3, "disable_by_batch_size": 2}'
    sched = make_scheduler(speculative_config=spec)
    reqs = _repetitive_reqs(4)
    for r, n in zip(reqs, (6, 10, 30, 30), strict=True):  # 4, then 3, then 2 running
        r.sampling = SamplingParams(max_tokens=n, ignore_eos=True)
    running_at_plan: list[tuple[int, bool]] = []

    def on_plan(_it: int, plan: Plan) -> None:
        running_at_plan.append((sched.num_running, any(s.draft for s in plan.seqs)))

    drive(sched, reqs, True, FakeWorker(256, 4, cyclic_sample), on_plan=on_plan)
    assert all(not drafted for running, drafted in running_at_plan if running > 2)
    assert any(drafted for running, drafted in running_at_plan if running <= 2)


def test_a_constrained_request_gets_no_draft():
    sched = make_scheduler(speculative_config=NGRAM)
    constrained = SamplingParams(max_tokens=20, ignore_eos=True, grammar=Grammar("regex", "a+"))
    reqs = [Req("g", [1, 2, 3] * 3, constrained)]
    plans: list[Plan] = []
    drive(
        sched, reqs, False, FakeWorker(256, 4, cyclic_sample), on_plan=lambda i, p: plans.append(p)
    )
    assert plans and not any(s.draft for p in plans for s in p.seqs)


def test_a_result_must_fit_its_plans_drafts():
    plan = Plan(3, [SeqStep(1, 10, 3, [], True, [4, 5]), SeqStep(2, 7, 1, [], True)])

    def result(num_tokens, tokens, **kw):
        r = StepResult(3, [1, 2], TokenRef(ids=tokens), num_tokens=num_tokens, **kw)
        return check_result(r, tokens, [1, 2], 100, plan)

    assert result([3, 1], [4, 5, 6, 7]) is None
    assert result([], [4, 7]) is None
    assert "allows 1 to 3" in result([4, 1], [4, 5, 6, 7, 8])
    assert "allows 1 to 1" in result([1, 2], [4, 7, 8])
    assert "allows" in result([0, 2], [7, 8])
    assert "token counts" in result([2], [4, 5])
    assert "tokens for" in result([2, 1], [4, 5])
    assert result([2, 1], [4, 5, 7], logprobs=[0.0, 0.0, 0.0]) is None
    assert "logprobs for 3 tokens" in result([2, 1], [4, 5, 7], logprobs=[0.0, 0.0])


# ------------------------------------------------------------------ the model path


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for n in (5, 9, 17, 30):
        out.append([rng.randrange(1, vocab) for _ in range(n)] * 3)  # lookups find something
    out.append([rng.randrange(1, vocab) for _ in range(23)])  # and one that may not
    return out


@pytest.mark.parametrize(
    "arch,flat",
    [
        ("llama", dict()),
        ("qwen2", dict(overlap=False)),
        ("qwen3", dict(max_num_batched_tokens=16)),  # chunked prefill beside drafts
        ("llama", dict(num_kv_blocks=40, block_size=4)),  # preemption
        ("qwen2", dict(enable_prefix_caching=False, block_size=4)),
    ],
)
def test_greedy_output_equals_transformers(tiny_models, arch, flat):
    torch.set_num_threads(1)
    path = tiny_models[arch]
    eng = LLM(path=path, speculative_config=NGRAM, **flat)
    prompts = _prompts(eng.runner.vocab_size)
    max_new = 24
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf.hf_greedy(path, p, max_new).tokens
    s = eng.scheduler.engine_stats()
    assert 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    if "num_kv_blocks" in flat:
        assert s.num_preempted_total > 0


def _avx2_few_rows() -> bool:
    from subway.kernels import cpu_ext

    ext = cpu_ext.load()
    return ext is not None and ext.small_linear_supported() and ext.has_avx2()


@pytest.mark.skipif(not _avx2_few_rows(), reason="AVX2's few-row kernel (up to 64 rows) only")
def test_bfloat16_greedy_is_the_same_bits_with_drafts_on_avx2(tiny_models):
    """On AVX2 a bfloat16 linear of up to 64 rows sums each row in one order whatever the
    row count, so one request's verification rows (up to 5 here) give the bits its one-token
    steps give: greedy output is identical with and without drafts even in bfloat16, where
    the tiny model's flat logits tie often. (Elsewhere a 5-row step may take another
    kernel, and bfloat16 ties may then part.)"""
    torch.set_num_threads(2)
    path = tiny_models["llama"]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    outs = []
    for cfg in ("", NGRAM):
        eng = LLM(path=path, dtype="bfloat16", speculative_config=cfg)
        outs.append([eng.generate([p], sp)[0].token_ids for p in _prompts(eng.runner.vocab_size)])
        if cfg:
            assert eng.scheduler.engine_stats().spec_accepted_tokens_total > 0
    assert outs[0] == outs[1]


def test_seeded_samples_equal_one_token_at_a_time(tiny_models):
    """Seeded noise is a function of (seed, position): with the draft verified by sampling
    every row, the tokens kept are the tokens decoding one at a time draws."""
    torch.set_num_threads(1)
    path = tiny_models["llama"]
    sp = SamplingParams(temperature=0.7, top_k=2, seed=7, max_tokens=30, logprobs=1)
    outs = []
    for cfg in ("", NGRAM):
        eng = LLM(path=path, speculative_config=cfg)
        outs.append(eng.generate(_prompts(eng.runner.vocab_size, seed=2), sp))
        if cfg:
            assert eng.scheduler.engine_stats().spec_accepted_tokens_total > 0
    for plain, spec in zip(*outs, strict=True):
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)


@pytest.mark.slow
def test_default_model_greedy_with_speculation(default_model):
    """A repetition-heavy prompt (copy a text), batched with others: token for token what
    decoding without drafts gives, and transformers (up to a verified near-tie)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    text = (
        "The harbour was quiet at dawn. Fishing boats rocked on the grey water, and the gulls "
        "waited on the posts for the first catch of the day."
    )
    prompts = [
        tok(f"Text: {text}\nThe same text, word for word: {text[:40]}")["input_ids"],
        tok("The capital of France is")["input_ids"],
        tok("def fibonacci(n):")["input_ids"],
    ]
    max_new = 32
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    plain = LLM(path=default_model, max_num_batched_tokens=32).generate(prompts, sp)
    eng = LLM(path=default_model, speculative_config=NGRAM, max_num_batched_tokens=32)
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    ties = sum(
        hf.compare(o.token_ids, hf.hf_greedy(default_model, p, max_new), o.top_ids)
        for p, o in zip(prompts, outs, strict=True)
    )
    assert ties <= 1
    s = eng.scheduler.engine_stats()
    assert s.spec_accepted_tokens_total >= 10  # the copied text is found and accepted


@pytest.mark.slow
def test_served_with_two_ranks_and_counted_on_metrics(tiny_models):
    """Every process, real sockets: two tensor-parallel ranks verify drafts alike (rank 0's
    samples, shared memory for the tokens), the greedy output is transformers', per-token
    logprobs come back for every token, and /metrics counts drafts and acceptances."""
    import httpx
    from transformers import AutoTokenizer

    from serving import Server

    path = tiny_models["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(len(tok), seed=5)[:3]
    spec = NGRAM.replace('"disable_by_batch_size": 8', '"disable_by_batch_size": 2')
    server = Server(path, "--speculative-config", spec, "-tp", "2", "--max-model-len", "512")
    try:
        with httpx.Client(timeout=120) as c:
            for p in prompts:
                body = {"model": "qwen2", "prompt": p, "max_tokens": 24, "temperature": 0,
                        "logprobs": 1, "ignore_eos": True}  # fmt: skip
                r = c.post(server.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert len(choice["logprobs"]["token_logprobs"]) == 24
                assert r.json()["usage"]["completion_tokens"] == 24
                assert choice["text"] == tok.decode(hf.hf_greedy(path, p, 24).tokens)
            metrics = c.get(server.url + "/metrics").text
    finally:
        server.stop()
    counts = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("subway:spec_decode")
    }
    assert counts["subway:spec_decode_num_drafts_total"] > 0
    assert (
        0
        < counts["subway:spec_decode_num_accepted_tokens_total"]
        < counts["subway:spec_decode_num_draft_tokens_total"]
    )
