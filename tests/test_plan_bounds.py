"""Plans carry each thing once, and a bad frame is a refused frame (issue 43).

Unit level: the scheduler sends a grammar's text to the workers once (`GrammarPrepare`),
holds its requests until rank 0 answers, ends them on a failed or overdue compile, and
lets the workers forget the grammar when its last request ends; a plan's NewSeqs stay
within half the message limit; a frame over the limit is refused by the `Codec`, not by
the socket. The same against a live server: `test_big_requests.py`.
"""

from __future__ import annotations

import msgspec
import pytest
from test_scheduler import EOS, Req, add, make_config, make_scheduler

from subway.ipc.messages import (
    Codec,
    Grammar,
    GrammarPrepare,
    GrammarReady,
    GrammarRelease,
    OversizedFrame,
    SamplingParams,
    ToWorker,
    grammar_key,
)
from subway.scheduler.request import RequestStatus
from subway.scheduler.scheduler import Scheduler

SCHEMA = Grammar("json_schema", '{"type": "object"}')


def _keyed(**kw):
    """A scheduler that sends grammars by key, as `subway serve`'s does."""
    return Scheduler(make_config(**kw), 256, 1024, [EOS], grammars_by_key=True)


def _grammar_req(rid: str, grammar: Grammar = SCHEMA) -> Req:
    return Req(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, grammar=grammar))


def test_a_grammar_goes_to_the_workers_once_and_its_requests_wait_for_it():
    sched = _keyed()
    for i in range(8):
        add(sched, _grammar_req(f"g{i}"))
    out = sched.grammars.take_outbox()
    assert out == [GrammarPrepare(grammar_key(SCHEMA), SCHEMA)]
    assert all(sched.get(f"g{i}").status is RequestStatus.COMPILING for i in range(8))
    assert sched.schedule() is None  # nothing to plan before rank 0 answers
    assert sched.has_work

    sched.on_grammar(GrammarReady(grammar_key(SCHEMA), True))
    plan = sched.schedule()
    assert plan is not None and len(plan.new_seqs) == 8
    for ns in plan.new_seqs:  # the plan names the grammar; its text stays behind
        assert ns.sampling.grammar.spec == "" and ns.sampling.grammar.key == grammar_key(SCHEMA)
    add(sched, _grammar_req("late"))  # ready already: queued at once, nothing sent again
    assert sched.get("late").status is RequestStatus.WAITING
    assert sched.grammars.take_outbox() == []

    for i in range(8):
        sched.abort(f"g{i}")
    assert sched.grammars.take_outbox() == []  # "late" still uses it
    sched.abort("late")
    assert sched.grammars.take_outbox() == [GrammarRelease([grammar_key(SCHEMA)])]


def test_a_failed_or_overdue_compile_ends_only_its_requests():
    now = [1000.0]
    sched = _keyed(grammar_timeout=2.0)
    sched.clock = lambda: now[0]
    bad, slow = Grammar("regex", "[a-"), Grammar("regex", "a+")
    add(sched, _grammar_req("bad", bad))
    now[0] += 1.0
    add(sched, _grammar_req("slow", slow))
    add(sched, Req("free", [1, 2, 3], SamplingParams(max_tokens=4)))
    sched.grammars.take_outbox()

    sched.on_grammar(GrammarReady(grammar_key(bad), False, "does not compile"))
    deltas = {d.request_id: d for d in sched.pop_pending_deltas()}
    assert deltas["bad"].finish_reason == "error" and deltas["bad"].error == "does not compile"
    assert sched.get("slow").status is RequestStatus.COMPILING
    assert sched.grammars.take_outbox() == [GrammarRelease([grammar_key(bad)])]

    now[0] += 2 * 2.0 + 30.0  # within the limit and its slack: still waiting
    sched.expire_grammars()
    assert sched.get("slow") is not None
    now[0] += 0.5
    sched.expire_grammars()
    assert [d.request_id for d in sched.pop_pending_deltas()] == ["slow"]
    plan = sched.schedule()  # the unconstrained request never waited for either
    assert plan is not None and [s.seq_id for s in plan.seqs] == [sched.get("free").seq_id]


def test_a_plan_stays_within_the_message_limit():
    limit = 16 * 1024
    sched = make_scheduler(
        num_blocks=4096, max_message_bytes=limit, max_num_batched_tokens=4096, max_num_seqs=64
    )
    prompt = list(range(40_000, 40_300))  # 300 ids inline: about 900 bytes a NewSeq
    for i in range(40):
        add(sched, Req(f"r{i}", prompt, SamplingParams(max_tokens=1)))
    enc = msgspec.msgpack.Encoder()
    admitted = 0
    while admitted < 40:
        plan = sched.schedule()
        assert plan is not None
        assert sum(len(enc.encode(ns)) for ns in plan.new_seqs) <= limit // 2
        assert len(enc.encode(plan)) <= limit
        assert 0 < len(plan.new_seqs) < 13  # the size, not the 4,096-token budget, cut it
        admitted += len(plan.new_seqs)
    assert admitted == 40


def test_a_request_no_plan_can_carry_ends_with_an_error():
    sched = make_scheduler(max_message_bytes=8 * 1024, max_model_len=8192)
    add(sched, Req("huge", list(range(1, 4000)), SamplingParams(max_tokens=1)))
    (delta,) = sched.pop_pending_deltas()
    assert delta.finish_reason == "error" and sched.get("huge") is None


def test_a_frame_over_the_limit_is_refused_by_the_codec():
    codec = Codec(ToWorker, 1000)
    big = codec.encode(GrammarPrepare(1, Grammar("regex", "a" * 2000)))
    with pytest.raises(OversizedFrame):
        codec.decode(big)
    with pytest.raises(msgspec.DecodeError):  # what every receiver counts as refused
        codec.decode(big)
    assert codec.decode(codec.encode(GrammarRelease([1]))) == GrammarRelease([1])
