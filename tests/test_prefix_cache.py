"""Prefix caching: shared prompt prefixes are computed once, and outputs do not change.

With the fake worker (which reads every sequence's KV back through its block
table and checks it), then through the real worker with the tiny models,
against Hugging Face greedy decoding.
"""

from __future__ import annotations

import random

import pytest
from test_scheduler import (
    VOCAB,
    FakeWorker,
    Out,
    Req,
    assert_matches_reference,
    drive,
    make_scheduler,
)

from subway.ipc.messages import Plan, SamplingParams

SP = SamplingParams(max_tokens=4, ignore_eos=True)


def first_steps(plans: list[Plan]) -> dict[int, list]:
    """seq id -> its SeqSteps, in plan order."""
    out: dict[int, list] = {}
    for p in plans:
        for s in p.seqs:
            out.setdefault(s.seq_id, []).append(s)
    return out


def collect_first_deltas(sched, reqs, overlap, worker):
    """drive(), also keeping each request's first delta (num_cached_tokens is on it)."""
    firsts = {}
    real = sched.process_result

    def spy(result, tokens):
        deltas = real(result, tokens)
        for d in deltas:
            firsts.setdefault(d.request_id, d)
        return deltas

    sched.process_result = spy
    outs = drive(sched, reqs, overlap, worker)
    return outs, firsts


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_second_request_with_same_prefix_schedules_only_its_new_tokens(overlap):
    rng = random.Random(0)
    prefix = [rng.randrange(1, VOCAB) for _ in range(100)]
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=64)
    worker = FakeWorker(64, 16)
    first = Req("first", prefix + [1, 2, 3], SP)
    second = Req("second", prefix + [7, 8, 9, 10, 11], SP)
    drive(sched, [first], overlap, worker)
    computed_before = worker.num_tokens_computed
    outs, firsts = collect_first_deltas(sched, [second], overlap, worker)

    steps = first_steps(worker.plans)
    s0 = steps[1][0]  # the second request's first step
    assert (s0.start_pos, s0.num_tokens, s0.sample) == (96, 105 - 96, True)
    first_table = [b for s in steps[0] for b in s.new_blocks]
    assert s0.new_blocks[:6] == first_table[:6]  # the cached blocks come first
    assert len(s0.new_blocks) == 7  # and one private block for positions 96..104
    # Its prompt cost 9 tokens of compute, not 105; then its 3 decodes.
    assert worker.num_tokens_computed - computed_before == 9 + 3
    assert firsts["second"].num_cached_tokens == 96
    assert firsts["second"].num_prompt_tokens == 105
    stats = sched.engine_stats()
    assert stats.prefix_cache_hits_total == 96
    assert stats.prefix_cache_queries_total == 103 + 105
    assert_matches_reference(outs, [second], sched.max_model_len)


def test_running_sequences_share_blocks_read_only():
    rng = random.Random(1)
    prefix = [rng.randrange(1, VOCAB) for _ in range(40)]
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    worker = FakeWorker(64, 4)  # fails if anyone writes into a block another holds
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    reqs = [Req(f"r{i}", prefix + [i + 1] * (i + 1), sp, arrival=3 * i) for i in range(4)]
    shared = []

    def on_plan(it, plan):
        bm = sched.block_manager
        shared.append(sum(1 for b in range(bm.num_blocks) if bm.ref_count(b) > 1))

    outs = drive(sched, reqs, overlap=True, worker=worker, on_plan=on_plan)
    assert max(shared) >= 10  # the 10 prefix blocks, held by several at once
    assert_matches_reference(outs, reqs, sched.max_model_len)
    assert sched.engine_stats().prefix_cache_hits_total == 3 * 40


@pytest.mark.parametrize("length,cached", [(32, 16), (33, 32), (31, 16), (15, 0)])
def test_a_fully_cached_prompt_still_computes_its_last_token(length, cached):
    prompt = list(range(1, length + 1))
    sched = make_scheduler(num_blocks=64, block_size=16)
    worker = FakeWorker(64, 16)
    drive(sched, [Req("a", prompt, SP)], False, worker)
    drive(sched, [Req("b", prompt, SP)], False, worker)
    s0 = first_steps(worker.plans)[1][0]
    assert (s0.start_pos, s0.num_tokens) == (cached, length - cached)


def test_stats_count_live_blocks_as_used_and_idle_cached_ones_as_free():
    sched = make_scheduler(num_blocks=32, block_size=4)
    worker = FakeWorker(32, 4)
    drive(sched, [Req("a", list(range(1, 18)), SP)], False, worker)  # 17 + 3 computed
    s = sched.engine_stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0
    assert s.kv_blocks_cached == 5  # positions 0..19 were computed: 5 full blocks
    assert s.kv_blocks_free == 32 and s.kv_blocks_total == 32


def test_output_tokens_are_cached_too():
    """A second turn that extends the first one's prompt and answer hits both."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    worker = FakeWorker(64, 4)
    prompt = list(range(1, 13))
    outs = drive(sched, [Req("turn1", prompt, SamplingParams(max_tokens=9, ignore_eos=True))],
                 False, worker)  # fmt: skip
    history = prompt + outs["turn1"].token_ids  # 21 tokens; 20 of them computed
    drive(sched, [Req("turn2", history + [5, 6, 7], SP)], False, worker)
    s0 = first_steps(worker.plans)[1][0]
    assert s0.start_pos == 20


def test_preempted_sequence_resumes_from_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=12, max_model_len=48, block_size=4)
    worker = FakeWorker(12, 4)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = [Req("a", [1] * 16, sp), Req("b", [2] * 16, sp)]
    outs = drive(sched, reqs, overlap=True, worker=worker)
    assert sched.num_preempted_total > 0
    resumed = []
    preempted: set[int] = set()
    for p in worker.plans:
        preempted.update(p.preempted)
        for s in p.seqs:
            if s.seq_id in preempted:  # its first step since the preemption
                resumed.append(s.start_pos)
                preempted.discard(s.seq_id)
    assert resumed and max(resumed) > 0  # came back with part of its KV still cached
    assert_matches_reference(outs, reqs, sched.max_model_len)


def test_disabled_prefix_cache_never_hits():
    sched = make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=False)
    worker = FakeWorker(64, 4)
    prompt = list(range(1, 30))
    drive(sched, [Req("a", prompt, SP)], False, worker)
    outs, firsts = collect_first_deltas(sched, [Req("b", prompt, SP)], False, worker)
    assert first_steps(worker.plans)[1][0].start_pos == 0
    s = sched.engine_stats()
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total, s.kv_blocks_cached) == (
        0,
        0,
        0,
    )
    assert firsts["b"].num_cached_tokens == 0


def shared_prefix_reqs(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 8))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.7)
        reqs.append(Req(f"r{i}", prompt, sp, arrival=rng.randrange(0, 40)))
    return reqs


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["big-pool", "tiny-pool"])
def test_outputs_identical_with_and_without_prefix_caching(num_blocks):
    reqs = shared_prefix_reqs(seed=3, n=30)
    results = {}
    for caching in (False, True):
        for overlap in (False, True):
            sched = make_scheduler(
                num_blocks=num_blocks,
                max_model_len=56,
                block_size=4,
                max_num_batched_tokens=24,
                enable_prefix_caching=caching,
            )
            outs = drive(sched, reqs, overlap)
            assert_matches_reference(outs, reqs, sched.max_model_len)
            results[caching, overlap] = {k: (o.token_ids, o.finish_reason) for k, o in outs.items()}
            if caching:
                assert sched.stats.prefix_hits_total > 0
            if num_blocks == 14:
                assert sched.num_preempted_total > 0
    assert all(r == results[False, False] for r in results.values())


# ---------------------------------------------------------------- through the real worker


def _engine(model: str, caching: bool, num_blocks: int, **kw):
    from subway.ipc.config import EngineConfig
    from subway.llm import LLM

    config = EngineConfig.build(
        path=model,
        run_id="pc",
        block_size=4,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        threads=1,
        enable_prefix_caching=caching,
        **kw,
    )
    return LLM(config)


def _run(engine, waves: list[list[list[int]]], sp: SamplingParams, overlap: bool) -> list[Out]:
    """Generate wave after wave (so that later waves find earlier ones' prefixes cached)."""
    outs = []
    for prompts in waves:
        outs += engine.generate(prompts, sp, overlap=overlap)
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_identical_with_prefix_cache_and_forced_preemption(tiny_models, arch):
    from reference import compare, hf_greedy

    path = tiny_models[arch]
    rng = random.Random(7)
    system = [rng.randrange(100, 5000) for _ in range(37)]
    prompts = [system + [rng.randrange(100, 5000) for _ in range(k)] for k in (3, 9, 1, 6)]
    prompts.append(list(prompts[1]))  # the same prompt again: fully cached but its last block
    prompts.append([rng.randrange(100, 5000) for _ in range(21)])  # shares nothing
    waves = [prompts[:1], prompts[1:]]
    max_new = 10
    sp = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=5)

    base = _run(_engine(path, False, 512), waves, sp, overlap=False)
    for prompt, out in zip(prompts, base, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == max_new
        compare(out.token_ids, hf_greedy(path, prompt, max_new), out.top_ids)
    want = [o.token_ids for o in base]

    # 20 blocks of 4 hold 80 tokens: one ~57-token sequence at a time, so admitted ones
    # preempt each other as they grow.
    for caching, blocks, overlap in [
        (True, 512, False),
        (True, 512, True),
        (True, 20, True),
        (False, 20, False),
    ]:
        engine = _engine(path, caching, blocks)
        got = _run(engine, waves, sp, overlap)
        assert [o.token_ids for o in got] == want, (caching, blocks, overlap)
        stats = engine.scheduler.engine_stats()
        if caching:  # the system prompt's 9 full blocks, for the 4 of wave 2 that have it
            assert stats.prefix_cache_hits_total >= (4 * 36 if blocks == 512 else 1)
        if blocks == 20:
            assert stats.num_preempted_total > 0
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == blocks


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    sched = make_scheduler(num_blocks=64, block_size=4)
    worker = FakeWorker(64, 4)
    prompt = list(range(1, 30))
    drive(sched, [Req("a", prompt, SP)], False, worker)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    drive(sched, [Req("b", prompt, sp)], False, worker)
    assert first_steps(worker.plans)[1][0].start_pos == 0


def test_first_delta_carries_queue_time_and_prompt_logprobs():
    from subway.ipc.messages import AddRequest, PromptLogprobs, StepResult, TokenRef

    now = [100.0]
    sched = make_scheduler()
    sched.clock = lambda: now[0]
    sp = SamplingParams(max_tokens=3, prompt_logprobs=1)
    sched.add(AddRequest("a", TokenRef(ids=[1, 2]), 2, sp, arrival_time=99.5), [1, 2])
    now[0] = 100.25
    plan = sched.schedule()
    lps = PromptLogprobs(logprobs=[-1.0])
    res = StepResult(plan.step, [0], TokenRef(ids=[5]), prompt_logprobs=[lps])
    (d,) = sched.process_result(res, [5])
    assert d.queue_time == 0.75 and d.prompt_logprobs == lps
    plan = sched.schedule()
    (d,) = sched.process_result(StepResult(plan.step, [0], TokenRef(ids=[6])), [6])
    assert d.queue_time is None and d.prompt_logprobs is None


def test_outputs_identical_under_hash_collisions(monkeypatch):
    """With a hash that collides all the time, the cache still never hands out a wrong
    block (the fake worker reads every KV slot back)."""
    from subway.scheduler import prefix_cache

    monkeypatch.setattr(prefix_cache, "_key_hash", lambda key: hash(key) % 3)
    reqs = shared_prefix_reqs(seed=5, n=30)
    for num_blocks in (256, 28):  # 28 blocks of 2: preemption
        sched = make_scheduler(num_blocks=num_blocks, max_model_len=56, block_size=2,
                               max_num_batched_tokens=24)  # fmt: skip
        outs = drive(sched, reqs, overlap=True)
        assert_matches_reference(outs, reqs, sched.max_model_len)
        assert sched.stats.prefix_hits_total > 0
        assert num_blocks == 256 or sched.num_preempted_total > 0
