"""The policies behind `--policy`: fcfs, priority, sjf, edf, static.

The driver's clock is its iteration: a request's arrival_time is the
iteration at which it arrives, so SLOs in milliseconds read as 1000 per
iteration, and an aging rate as tokens per iteration.
"""

from __future__ import annotations

import pytest
from test_scheduler import FakeWorker, Req, assert_matches_reference, drive, make_scheduler

from subway.ipc.messages import SamplingParams
from subway.scheduler.policy import EDF, POLICIES, SJF, Priority, make_policy


class Recorder:
    """Follows a driven scheduler: when each request was first admitted, and preemptions."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.rid: dict[int, str] = {}  # seq id -> request id
        self.admitted: dict[str, int] = {}  # request id -> plan index of its first step
        self.order: list[str] = []  # first admissions, in order
        self.preempted: list[str] = []
        self.num_plans = 0
        real_add = sched.add

        def add(req, ids):
            real_add(req, ids)
            seq = sched.get(req.request_id)
            if seq is not None:
                self.rid[seq.seq_id] = req.request_id

        sched.add = add

    def __call__(self, it: int, plan) -> None:
        for ns in plan.new_seqs:
            rid = self.rid[ns.seq_id]
            self.admitted[rid] = self.num_plans
            self.order.append(rid)
        self.preempted += [self.rid[s] for s in plan.preempted]
        self.num_plans += 1


def run(policy, reqs, overlap=False, **cfg):
    sched = make_scheduler(policy=policy, **cfg)
    rec = Recorder(sched)
    worker = FakeWorker(sched.block_manager.num_blocks, sched.block_manager.block_size)
    outs = drive(sched, reqs, overlap, worker, on_plan=rec)
    assert_matches_reference(outs, reqs, sched.max_model_len)
    return sched, rec, outs


def test_every_cli_policy_exists_and_unknown_names_fail():
    import dataclasses

    from subway.ipc.config import SchedulerConfig

    (policy,) = [f for f in dataclasses.fields(SchedulerConfig) if f.name == "policy"]
    CLI = policy.metadata["choices"]  # the CLI's --policy choices come from this field
    assert set(CLI) == set(POLICIES)
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError):
        make_policy("lifo")
    with pytest.raises(ValueError):
        SJF(aging_rate=0)


def test_fcfs_admits_in_arrival_order():
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    reqs = [Req(f"r{i}", [i + 1] * (10 - i), sp) for i in range(6)]
    _, rec, _ = run(make_policy("fcfs"), reqs, max_num_seqs=2)
    assert rec.order == [f"r{i}" for i in range(6)]


# ---------------------------------------------------------------- priority


def test_priority_orders_the_queue_lower_first():
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [Req("first", [1, 2], sp, priority=9)]  # takes the only seat at iteration 0
    reqs += [Req(f"p{p}", [3, 4], sp, arrival=1, priority=p) for p in (2, 0, 1, 0)]
    reqs[-1].request_id = "p0-later"
    _, rec, _ = run(Priority(), reqs, max_num_seqs=1)
    # `first` is preempted by the better ones as they come (a seat is short), then last.
    assert rec.order == ["first", "p0", "p0-later", "p1", "p2"]


def test_priority_arrival_preempts_worse_running_work_for_a_seat():
    low = Req("low", [1, 2, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True), priority=5)
    high = Req("high", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), arrival=5)
    sched, rec, outs = run(Priority(), [low, high], max_num_seqs=1)
    assert rec.preempted == ["low"]
    assert rec.admitted["high"] <= 6
    assert sched.num_preempted_total == 1


def test_priority_arrival_preempts_worse_running_work_for_blocks():
    # 8 blocks of 4: low grows to 30 tokens; high's 12-token prompt needs 3 blocks.
    low = Req("low", [1] * 20, SamplingParams(max_tokens=10, ignore_eos=True), priority=1)
    high = Req("high", [2] * 12, SamplingParams(max_tokens=2, ignore_eos=True), arrival=3)
    sched, rec, outs = run(Priority(), [low, high], num_blocks=8, max_model_len=32, max_num_seqs=4)
    assert rec.preempted == ["low"]
    assert rec.admitted["high"] <= 4


def test_equal_priorities_never_preempt_each_other():
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [Req(f"r{i}", [i + 1] * 6, sp, arrival=i) for i in range(4)]
    sched, rec, _ = run(Priority(), reqs, max_num_seqs=1)
    assert rec.preempted == [] and rec.order == ["r0", "r1", "r2", "r3"]


# ---------------------------------------------------------------- sjf


def test_sjf_serves_shorter_jobs_first():
    reqs = [Req("blocker", [1], SamplingParams(max_tokens=4, ignore_eos=True))]
    for name, plen, mt in [("long", 10, 30), ("short", 2, 3), ("mid", 5, 10)]:
        reqs.append(Req(name, [2] * plen, SamplingParams(max_tokens=mt, ignore_eos=True), 1))
    _, rec, _ = run(SJF(), reqs, max_num_seqs=1)
    assert rec.order == ["blocker", "short", "mid", "long"]


def stream_with_long_job(n_short: int) -> list[Req]:
    """One job of 100 tokens at iteration 1 among short ones (10 tokens), one per iteration:
    more work than two seats can serve, so the queue only grows while they come."""
    reqs = [
        Req(f"s{i}", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True), arrival=i)
        for i in range(n_short)
    ]
    reqs.append(Req("long", [5] * 10, SamplingParams(max_tokens=90, ignore_eos=True), arrival=1))
    return reqs


def test_sjf_aging_bounds_the_wait_of_a_long_job():
    """The bound: a job of size L arriving at a is admitted before any job that arrives after
    a + L / aging_rate. Here L = 100, a = 1, aging_rate = 1 token per iteration: no short job
    arriving after iteration 101 goes first, however many keep coming."""
    reqs = stream_with_long_job(300)
    arrival = {r.request_id: r.arrival for r in reqs}
    _, rec, _ = run(SJF(aging_rate=1.0), reqs, max_num_seqs=2, max_num_batched_tokens=64)
    before = rec.order[: rec.order.index("long")]
    assert before and max(arrival[r] for r in before) <= 1 + 100 / 1.0
    # Without (nearly) any aging, the long job waits until the stream has dried up.
    _, rec, _ = run(SJF(aging_rate=1e-9), reqs, max_num_seqs=2, max_num_batched_tokens=64)
    assert rec.order[-1] == "long"


# ---------------------------------------------------------------- edf


def test_edf_serves_earliest_deadline_first():
    mk = lambda name, slo, cls="interactive": Req(  # noqa: E731
        name, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), 1, None, 0, slo, cls
    )
    reqs = [Req("blocker", [9], SamplingParams(max_tokens=4, ignore_eos=True))]
    reqs += [mk("loose", 9000), mk("tight", 2000), mk("batch", None, "batch"), mk("default", None)]
    _, rec, _ = run(EDF(interactive_ttft_ms=5000, batch_ttft_ms=60000), reqs, max_num_seqs=1)
    assert rec.order == ["blocker", "tight", "default", "loose", "batch"]


def test_edf_interactive_arrival_preempts_a_batch_job():
    batch = Req("batch", [1] * 8, SamplingParams(max_tokens=40, ignore_eos=True), slo_class="batch")
    chat = Req("chat", [2] * 4, SamplingParams(max_tokens=3, ignore_eos=True), arrival=6)
    _, rec, _ = run(EDF(), [batch, chat], max_num_seqs=1)
    assert rec.preempted == ["batch"] and rec.admitted["chat"] <= 7


def test_edf_never_preempts_a_batch_job_past_its_deadline_nor_interactive_work():
    # The batch job's deadline (iteration 2) is before the chat's (iteration 6 + 1).
    batch = Req("batch", [1] * 8, SamplingParams(max_tokens=20, ignore_eos=True))
    batch.slo_class, batch.slo_ttft_ms = "batch", 2000
    chat = Req("chat", [2] * 4, SamplingParams(max_tokens=3, ignore_eos=True), arrival=6)
    other = Req("other", [3] * 4, SamplingParams(max_tokens=3, ignore_eos=True), arrival=6)
    other.slo_ttft_ms = 1.0
    _, rec, _ = run(EDF(), [batch, chat, other], max_num_seqs=1)
    assert rec.preempted == []
    assert rec.order == ["batch", "other", "chat"]


def test_edf_bounds_the_wait_of_batch_jobs():
    """A batch job is admitted before any request that arrives after its deadline, however
    many interactive ones keep coming (here: its deadline is iteration 1 + 50)."""
    reqs = [
        Req(f"chat{i}", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True), arrival=i)
        for i in range(200)
    ]
    reqs.append(
        Req("batch", [5] * 10, SamplingParams(max_tokens=20, ignore_eos=True), 1, slo_class="batch")
    )
    arrival = {r.request_id: r.arrival for r in reqs}
    edf = EDF(interactive_ttft_ms=5000, batch_ttft_ms=50000)
    sched, rec, _ = run(edf, reqs, max_num_seqs=2)
    before = rec.order[: rec.order.index("batch")]
    assert before and max(arrival[r] for r in before) <= 1 + 50
    assert len(rec.order) - rec.order.index("batch") > 100  # long before the stream ends
    assert "batch" not in rec.preempted  # later arrivals have later deadlines: no preemption


# ---------------------------------------------------------------- static


def test_static_admits_a_batch_only_when_the_last_one_is_done():
    sp = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    reqs = [Req(f"r{i}", [i + 1] * 3, sp(3 + 5 * (i % 3))) for i in range(9)]
    sched = make_scheduler(policy=make_policy("static"), max_num_seqs=3)
    rec = Recorder(sched)
    running_sets = []

    def on_plan(it, plan):
        rec(it, plan)
        live = {s.seq_id for s in sched.running if s.status.name == "RUNNING"}
        assert live <= sched.policy.members  # nobody outside the batch runs
        running_sets.append(live)

    outs = drive(sched, reqs, False, FakeWorker(256, 4), on_plan=on_plan)
    assert_matches_reference(outs, reqs, sched.max_model_len)
    assert rec.order == [f"r{i}" for i in range(9)]
    # Batches of 3, all admitted in one step; the next starts only after the longest of
    # the last (13 tokens: 13 steps) has finished.
    starts = [rec.admitted[f"r{i}"] for i in range(9)]
    assert starts == [0] * 3 + [13] * 3 + [26] * 3
    continuous = make_scheduler(policy=make_policy("fcfs"), max_num_seqs=3)
    fw = FakeWorker(256, 4)
    drive(continuous, reqs, False, fw)
    assert len(fw.plans) < sched.stats.num_steps_planned  # what continuous batching buys
