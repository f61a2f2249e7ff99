"""SLO-aware scheduling: the step cost model, EDF's slack and TPOT cap, late planning.

The policy tests drive the real scheduler with the fake worker on an
iteration clock (one iteration reads as one second) and a fixed step cost, so
each decision can be worked out by hand; outputs still match the reference.
"""

from __future__ import annotations

import pytest
from test_scheduler import (
    FakeWorker,
    Req,
    add,
    assert_matches_reference,
    drive,
    make_config,
)

from subway.ipc.messages import SamplingParams
from subway.scheduler.engine_core import EngineCore
from subway.scheduler.policy import EDF, make_policy
from subway.scheduler.scheduler import Scheduler
from subway.scheduler.slo import StepCost


class FixedCost:
    """A step cost model that already knows: every step takes `step_s`, `per_token` each."""

    ready = True

    def __init__(self, step_s: float, per_token: float = 0.0) -> None:
        self.step_s, self.per_token = step_s, per_token

    def observe(self, tokens: int, seconds: float, decode_kv: int = 0, decodes: int = 0) -> None:
        pass

    def predict(self, tokens: int, decode_kv: int = 0, decodes: int = 0) -> float:
        return self.step_s + self.per_token * tokens

    def tokens_within(self, seconds: float, decode_kv: int = 0, decodes: int = 0) -> int:
        return int((seconds - self.step_s) / self.per_token)


def edf_scheduler(policy: EDF, cost, **cfg) -> tuple[Scheduler, list[int]]:
    """A scheduler whose clock is the driver's iteration (`now[0]`)."""
    now = [0]
    sched = Scheduler(
        make_config(**cfg), 256, 1024, [0], clock=lambda: float(now[0]), policy=policy
    )
    sched.step_cost = cost
    return sched, now


def run(sched, now, reqs, on_plan=None, overlap=False):
    worker = FakeWorker(sched.block_manager.num_blocks, sched.block_manager.block_size)
    on_iteration = lambda it: now.__setitem__(0, it)  # noqa: E731
    outs = drive(sched, reqs, overlap, worker, on_plan=on_plan, on_iteration=on_iteration)
    assert_matches_reference(outs, reqs, sched.max_model_len)
    return outs


def sp(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class Admissions:
    """Which request each plan admitted first (by request id), and whom it preempted."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.first, self.preempted, self.plans = sched, {}, [], 0
        self.rid: dict[int, str] = {}

    def __call__(self, it, plan) -> None:
        for rid in self.sched.request_ids():
            self.rid.setdefault(self.sched.get(rid).seq_id, rid)
        for ns in plan.new_seqs:
            self.first.setdefault(self.rid[ns.seq_id], self.plans)
        self.preempted += [self.rid[s] for s in plan.preempted]
        self.plans += 1


# ---------------------------------------------------------------- the cost model


def truth(tokens: int, kv: int) -> float:
    """A machine where a decode's context costs: 15 ms + 0.3 ms a token + 2 us a position."""
    return 0.015 + 3e-4 * tokens + 2e-6 * kv


def test_step_cost_tells_prefill_tokens_from_decode_context():
    """Steps of mixed prefill and decodes at varied contexts: the fit finds all three
    coefficients, so a decode-heavy step is predicted as well as a prefill-heavy one."""
    cost = StepCost()
    assert not cost.ready
    for i in range(60):
        decodes = 8 + (i * 7) % 40
        kv = decodes * (100 + (i * 53) % 900)
        tokens = decodes + (i * 131) % 512
        cost.observe(tokens, truth(tokens, kv), kv)
    assert cost.ready
    for tokens, kv in ((40, 40_000), (500, 0), (100, 5_000)):
        assert cost.predict(tokens, kv) == pytest.approx(truth(tokens, kv), rel=0.02)
    assert cost.tokens_within(0.095, 20_000) == pytest.approx(133, abs=2)  # (95-15-40)/0.3
    assert cost.tokens_within(0.05, 20_000) == 0  # the decodes' context alone is 40 ms


def test_step_cost_tells_a_prefill_token_from_a_decode_token():
    """A CPU where a decode token rides on the step's weight read (0.1 ms) and a prefill
    token pays its share of the compute (1.6 ms): decode-only steps and steps with a
    prefill chunk beside the decodes fit both, and a decoding step's prefill room is
    priced at the prefill cost."""

    def machine(prefill: int, decodes: int, kv: int) -> float:
        return 0.03 + 1.6e-3 * prefill + 1e-4 * decodes + 1e-6 * kv

    cost = StepCost()
    for i in range(80):
        decodes = 4 + (i * 5) % 24
        kv = decodes * (100 + (i * 37) % 400)
        prefill = 0 if i % 3 else 16 + (i * 29) % 240
        cost.observe(prefill + decodes, machine(prefill, decodes, kv), kv, decodes)
    assert cost.per_token == pytest.approx(1.6e-3, rel=0.05)
    assert cost.per_decode < 3e-4  # (its effect, a few ms, sits within the prior's pull)
    step = cost.predict(12, 2400, decodes=12)
    assert step == pytest.approx(machine(0, 12, 2400), rel=0.15)  # the prior pulls a little
    # A step may grow by that much again: about 22 prefill tokens beside its 12 decodes.
    assert cost.tokens_within(2 * step, 2400, decodes=12) - 12 == pytest.approx(22, abs=5)


def test_step_cost_holds_its_prior_where_steps_are_alike_and_ignores_stalls():
    cost = StepCost(per_token=1e-4, per_kv=1e-6)
    for _ in range(30):
        cost.observe(32, 0.05, 10_000)
    cost.observe(32, 120.0, 10_000)  # a suspended process: no signal
    cost.observe(0, 0.01)  # an empty step
    assert cost.predict(32, 10_000) == pytest.approx(0.05, rel=0.01)
    # Nothing told the slopes apart: they stay near the prior, the base takes the rest.
    assert 0.5e-4 < cost.per_token < 2e-4 and 0.5e-6 < cost.per_kv < 2e-6


# ---------------------------------------------------------------- slack


def test_a_chat_with_slack_waits_for_a_seat_instead_of_preempting():
    """Two seats: a long batch job and a short chat run. A chat arriving at 2 with a 5 s SLO
    can wait for the short one to end (3 steps of 0.1 s, its prefill 0.2 s): no preemption."""
    sched, now = edf_scheduler(EDF(), FixedCost(0.1), max_num_seqs=2)
    reqs = [
        Req("batch", [1] * 8, sp(40), slo_class="batch"),
        Req("short", [2] * 4, sp(4)),
        Req("chat", [3] * 4, sp(3), arrival=2, slo_ttft_ms=5000),
    ]
    rec = Admissions(sched)
    run(sched, now, reqs, rec)
    assert rec.preempted == []
    assert sched.stats.slo_waits_total > 0 and sched.stats.num_displaced_total == 0
    assert rec.first["chat"] > rec.first["short"]


def test_a_chat_without_slack_preempts_the_batch_job_with_least_work_to_lose():
    """Both seats hold batch jobs with 30+ tokens to go; a chat with a 1 s SLO cannot wait.
    It preempts the job with the fewest computed tokens (`small`), not the latest (`big`)."""
    sched, now = edf_scheduler(EDF(), FixedCost(0.1), max_num_seqs=2)
    reqs = [
        Req("small", [1] * 4, sp(40), slo_class="batch"),
        Req("big", [2] * 30, sp(40), slo_class="batch"),
        Req("chat", [3] * 4, sp(3), arrival=3, slo_ttft_ms=1000),
    ]
    rec = Admissions(sched)
    run(sched, now, reqs, rec)
    assert rec.preempted == ["small"]
    assert sched.stats.num_displaced_total == 1
    assert rec.first["chat"] <= 4


def test_before_the_cost_model_is_ready_a_chat_preempts_at_once():
    policy = EDF()
    sched, now = edf_scheduler(policy, StepCost(), max_num_seqs=1)
    reqs = [Req("batch", [1] * 4, sp(40), slo_class="batch"), Req("chat", [3] * 4, sp(3), 2)]
    rec = Admissions(sched)
    run(sched, now, reqs, rec)
    assert rec.preempted == ["batch"]  # the real cost model has seen under 4 steps by then


# ---------------------------------------------------------------- the TPOT cap


def step_tokens(sched: Scheduler, log: list[tuple[int, bool, int]]):
    """Each plan: (its tokens, whether a chat was live, its batch-class tokens)."""

    def on_plan(it, plan) -> None:
        batch = {r.seq_id for r in sched.by_seq.values() if r.slo_class == "batch"}
        tokens = sum(s.num_tokens for s in plan.seqs)
        batch_tokens = sum(s.num_tokens for s in plan.seqs if s.seq_id in batch)
        log.append((tokens, sched.num_interactive > 0, batch_tokens))

    return on_plan


@pytest.mark.parametrize("overlap", [False, True])
def test_tpot_cap_shrinks_batch_chunks_only_while_a_chat_is_live(overlap):
    """Budget 64; a step costs 0.1 s + 0.01 s a token; an iteration is a second. While the
    chat lives, a step may take 0.4 x its 1 s TTFT SLO (the next chat to arrive), and is
    planned at 0.8 of that: 22 tokens, fewer once the chat's TPOT budget (0.9 s a token,
    against the driver's 1 s pace) runs out. Before and after it, batch chunks fill the 64."""
    policy = EDF(interactive_ttft_ms=1000, tpot_ms=900)
    sched, now = edf_scheduler(policy, FixedCost(0.1, 0.01))
    assert policy.batch_chunk_cap(0, 0) is None  # no step begun: no cap
    reqs = [
        Req("batch", [1] * 150, sp(4), slo_class="batch"),
        Req("chat", [2] * 4, sp(12), arrival=1),
        Req("late_batch", [3] * 300, sp(4), arrival=3, slo_class="batch"),
    ]
    log: list[tuple[int, bool, int]] = []
    run(sched, now, reqs, step_tokens(sched, log), overlap)
    live = [t for t, chat, _ in log if chat]
    assert live and max(live) <= 22 and 22 in live
    assert min(live[-2:]) < 22  # the chat's TPOT budget ran out: the cap tightened
    assert max(b for t, chat, b in log if not chat) == 64
    assert sched.stats.chunk_capped_steps_total > 0


def test_step_bound_is_the_tightest_chat_deadline():
    """The bound by hand: TPOT 100 ms, TTFT 500 ms, later steps 50 ms, now = 10 s."""
    from types import SimpleNamespace as NS

    from subway.scheduler.policy import StepView
    from subway.scheduler.request import RequestStatus
    from subway.scheduler.slo import StepCost
    from subway.scheduler.stats import SchedulerStats

    run_ = RequestStatus.RUNNING
    policy = EDF(interactive_ttft_ms=500, tpot_ms=100)

    def chat(**kw):
        base = dict(slo_class="interactive", status=run_, slo_ttft_ms=None, arrival_time=9.8,
                    prompt_len=10, token_limit=51, output_ids=[0] * 5, num_inflight=1,
                    first_token_time=9.0)  # fmt: skip
        return NS(**(base | kw))

    def bound(running, waiting=()):
        view = StepView(
            lambda: 10.0, list(waiting), running, len(running), len(running), 8, 64,
            StepCost(), SchedulerStats(),
        )  # fmt: skip
        policy.begin_step(view)
        return policy.step_bound(0.05)

    assert bound([]) == pytest.approx(0.2)  # 0.4 x 500 ms: the next arrival
    # 41 outputs: 4 s of budget, 1 s spent, 34 more steps of 50 ms: 1.3 s left
    assert bound([chat()]) == pytest.approx(0.2)
    # 11 outputs, 9 out and 1 in flight, 1.2 s spent: 1.0 - 1.2 = -0.2 s
    late = chat(token_limit=21, output_ids=[0] * 9, first_token_time=8.8)
    assert bound([chat(), late]) == pytest.approx(-0.2)
    # before its first token: its deadline (9.8 + 0.5) is 0.3 s away
    assert bound([chat(first_token_time=None)]) == pytest.approx(0.2)
    assert bound([chat(first_token_time=None, arrival_time=9.65)]) == pytest.approx(0.15)
    batch = chat(slo_class="batch", first_token_time=None, arrival_time=0.0)
    assert bound([batch]) == pytest.approx(0.2)  # batch requests bound nothing
    waiting = [batch, chat(first_token_time=None, arrival_time=9.6, status=None)]
    assert bound([], waiting) == pytest.approx(0.1)  # the earliest waiting chat


def test_the_first_batch_chunk_gets_a_block_and_an_unreachable_slo_caps_nothing():
    """32 chats decode (32 tokens, 42 ms by the model: over a 40 ms SLO, which nothing could
    meet): no cap. With a 45 ms SLO the cap (26 tokens) is below the decodes: the batch
    prompt still gets one block (4 tokens) a step, and only it."""
    for tpot_ms, want in ((40.0, 64 - 32), (45.0, 4)):
        sched, now = edf_scheduler(EDF(tpot_ms=tpot_ms), FixedCost(0.01, 0.001), max_num_seqs=40)
        reqs = [Req(f"chat{i}", [2, i], sp(12)) for i in range(32)]
        reqs += [Req(f"batch{i}", [1] * 100, sp(2), arrival=2, slo_class="batch") for i in range(2)]
        log: list[tuple[int, bool, int]] = []
        run(sched, now, reqs, step_tokens(sched, log))
        batch_while_chats = [b for t, chat, b in log if chat and b]
        assert batch_while_chats and max(batch_while_chats) == want, tpot_ms


def test_without_a_tpot_slo_batch_chunks_take_the_whole_budget():
    sched, now = edf_scheduler(EDF(), FixedCost(0.01, 0.001))
    reqs = [Req("batch", [1] * 150, sp(4), slo_class="batch"), Req("chat", [2] * 4, sp(12), 1)]
    log: list[tuple[int, bool, int]] = []
    run(sched, now, reqs, step_tokens(sched, log))
    assert max(t for t, chat, _ in log if chat) == 64
    assert sched.stats.chunk_capped_steps_total == 0


def test_edf_options_are_checked():
    with pytest.raises(ValueError):
        make_policy("edf", tpot_ms=-1.0)
    with pytest.raises(ValueError):
        make_policy("edf", interactive_ttft_ms=float("nan"))
    from subway.tools.cli import check_policy

    with pytest.raises(SystemExit, match="policy edf"):
        check_policy(make_config(policy="edf", slo_tpot_ms=-5.0))
    check_policy(make_config(policy="edf", slo_tpot_ms=100.0, slo_ttft_ms=500.0))


# ---------------------------------------------------------------- late planning


class Held:
    """An executor that keeps its plans: nothing comes back unless `finish` is called."""

    def __init__(self) -> None:
        self.plans = []

    def submit(self, plan) -> None:
        self.plans.append(plan)

    def collect(self):
        return []


@pytest.mark.parametrize("late", [False, True])
def test_late_planning_lets_a_request_arriving_mid_step_join_the_next_step(late):
    """Step 0 runs (predicted 100 ms). A request arrives at 50 ms. With late planning plan 1
    is made at 83 ms (85% of 100 ms, less the lead) and admits it; without, plan 1 was made
    at 0 ms and it waits for plan 2."""
    t = [0.0]
    sched = Scheduler(make_config(), 256, 1024, [0], clock=lambda: t[0])
    sched.step_cost = FixedCost(0.1)
    core = EngineCore(sched, Held(), depth=2, late_planning=late, clock=lambda: t[0])
    add(sched, Req("first", [1] * 4, sp(20)), arrival_time=0.0)
    assert core.plan() == (1 if late else 2)
    if late:
        assert core.wake_in() == pytest.approx(0.083, abs=2e-3)
    t[0] = 0.05
    add(sched, Req("second", [2] * 4, sp(20)), arrival_time=0.05)
    core.plan()
    if late:
        assert not core.executor.plans[1:]  # not yet due
        t[0] = 0.09
        assert core.plan() == 1 and core.wake_in() is None
    second = sched.get("second").seq_id
    admitted_in = [i for i, p in enumerate(core.executor.plans) if second in
                   [ns.seq_id for ns in p.new_seqs]]  # fmt: skip
    assert admitted_in == ([1] if late else [])  # without: only plan 2, not made yet


@pytest.mark.parametrize("arrivals", [1, 20])
def test_late_planning_waits_only_while_arrivals_pay_for_the_wake(arrivals):
    """Where a wake costs the step (CPU workers), a 10 ms step waits for its late plan only
    if arrivals are frequent: at 1/s (two in the last 2 s) 1 x 0.01 x 0.01 s is under the
    0.3 ms wake, so plan 1 goes with plan 0; at 10.5/s (21 in 2 s) it is over: it waits."""
    t = [100.0]
    sched = Scheduler(make_config(), 256, 1024, [0], clock=lambda: t[0])
    sched.step_cost = FixedCost(0.01)
    core = EngineCore(sched, Held(), 2, late_planning=True, clock=lambda: t[0], wake_cost_s=3e-4)
    for i in range(arrivals):  # the older ones arrived over the last 2 s, and finished
        t[0] = 98.01 + i * 0.099
        add(sched, Req(f"old{i}", [3] * 4, sp(1)), arrival_time=t[0])
        sched.abort(f"old{i}")
    t[0] = 100.0
    add(sched, Req("first", [1] * 4, sp(20)), arrival_time=t[0])
    if arrivals == 1:
        assert sched.arrival_rate() == pytest.approx(1.0)  # itself and one other in 2 s
    assert core.plan() == (1 if arrivals == 20 else 2)
    assert (core.wake_in() is not None) == (arrivals == 20)
    t[0] = 102.5  # the stamps age out of the window
    assert sched.arrival_rate() == 0.0
