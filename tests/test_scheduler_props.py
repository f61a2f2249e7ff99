"""Property tests: random arrivals, lengths, shared prefixes, aborts, tiny block pools, every
policy, prefix caching on and off, with and without overlap.

What must hold, whatever hypothesis draws (the fake worker and `drive` check
most of it on every plan and every iteration):

- every request ends exactly once: stop, length, abort, or error at once;
  and unless aborted, with the output of the request generated alone
  (so preemption and prefix caching change nothing);
- no block is leaked or double-freed, ref counts match the block tables, and
  every block is free, held, or cached-evictable, never two of these
  (`check_block_manager`, every iteration; all blocks come back at the end);
- block tables never share a writable block: a block is in two tables only
  if it is a full, cached one, and the fake worker fails any write into a
  block that another sequence holds, and any read of KV that is not the
  sequence's own;
- a plan never exceeds `max_num_batched_tokens` or `max_num_seqs`, nor does
  the running set;
- admission follows the policy's key: when a request is first admitted, every
  request with a smaller key that had arrived (and was not aborted) has been
  admitted too. For `sjf` and `edf` that is the no-starvation bound: with
  `sjf`, a request of expected size L arriving at a is admitted before any
  request arriving after a + L / aging_rate; with `edf`, before any request
  arriving after its deadline.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import check_block_manager
from test_scheduler import VOCAB, FakeWorker, Req, drive, make_scheduler, reference
from test_slo import FixedCost

from subway.ipc.messages import SamplingParams
from subway.scheduler.policy import EDF, SJF, make_policy


@st.composite
def workloads(draw):
    prefixes = [
        [draw(st.integers(1, VOCAB - 1)) for _ in range(draw(st.integers(0, 20)))] for _ in range(2)
    ]
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        head = draw(st.sampled_from([[], *prefixes]))
        tail = [(7 * i + j) % VOCAB for j in range(draw(st.integers(0, 12)))]
        sp = SamplingParams(
            max_tokens=draw(st.integers(0, 25)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)),
        )
        reqs.append(
            Req(
                f"r{i}",
                head + tail,
                sp,
                arrival=draw(st.integers(0, 30)),
                abort_at=draw(st.one_of(st.none(), st.integers(0, 50))),
                priority=draw(st.integers(0, 3)),
                slo_ttft_ms=draw(st.one_of(st.none(), st.floats(1000, 20000))),
                slo_class=draw(st.sampled_from(["interactive", "batch"])),
            )
        )
    name = draw(st.sampled_from(["fcfs", "priority", "sjf", "edf", "static"]))
    if name == "sjf":
        policy = SJF(aging_rate=draw(st.floats(0.5, 20)))
    elif name == "edf":
        policy = EDF(
            interactive_ttft_ms=draw(st.floats(1000, 5000)),
            batch_ttft_ms=draw(st.floats(5000, 50000)),
            tpot_ms=draw(st.sampled_from([0.0, 100.0])),
        )
        policy.cap_tokens = draw(st.integers(1, 24))  # with tpot_ms: the TPOT cap's tokens
    else:
        policy = make_policy(name)
    cfg = dict(
        num_blocks=draw(st.integers(1, 24)),
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_model_len=draw(st.integers(1, 80)),
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_num_seqs=draw(st.integers(1, 8)),
        enable_prefix_caching=draw(st.booleans()),
    )
    return reqs, policy, cfg, draw(st.booleans())


class Events:
    """A clock of adds, aborts and plans, and what happened at each."""

    def __init__(self, sched) -> None:
        self.t = 0
        self.added: dict[str, int] = {}
        self.aborted: dict[str, int] = {}
        self.admitted: dict[str, int] = {}
        self.keys: dict[str, object] = {}
        self.seqs: dict[str, object] = {}
        self.rid: dict[int, str] = {}
        real_add, real_abort = sched.add, sched.abort

        def add(req, ids):
            self.t += 1
            real_add(req, ids)
            seq = sched.get(req.request_id)
            if seq is not None:
                self.added[req.request_id] = self.t
                self.keys[req.request_id] = sched.policy.key(seq)
                self.seqs[req.request_id] = seq
                self.rid[seq.seq_id] = req.request_id

        def abort(rid):
            self.t += 1
            self.aborted.setdefault(rid, self.t)
            real_abort(rid)

        sched.add, sched.abort = add, abort

    def on_plan(self, it, plan) -> None:
        self.t += 1
        for ns in plan.new_seqs:
            self.admitted[self.rid[ns.seq_id]] = self.t


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_properties(work):
    reqs, policy, cfg, overlap = work
    sched = make_scheduler(policy=policy, **cfg)
    if isinstance(policy, EDF) and policy.tpot_s:
        # A cost model by which `cap_tokens` fit in the cap (0.8 x the TPOT SLO), and the
        # decodes alone miss the SLO past 1.25 x as many: both branches of the cap run.
        sched.step_cost = FixedCost(0.0, 0.08 / policy.cap_tokens)
    bm = sched.block_manager
    worker = FakeWorker(bm.num_blocks, bm.block_size)
    ev = Events(sched)
    outs = drive(sched, reqs, overlap, worker, on_plan=ev.on_plan)

    # Every request ended once, with the reference's output unless aborted.
    for r in reqs:
        o = outs[r.request_id]
        assert o.finish_reason in ("stop", "length", "abort", "error")
        if o.finish_reason == "error":
            assert len(r.prompt) == 0 or len(r.prompt) > sched.max_model_len
        elif o.finish_reason != "abort":
            if o.token_ids:
                ref = reference(r, sched.max_model_len)
                assert (o.token_ids, o.finish_reason) == (ref.token_ids, ref.finish_reason)
            else:  # no room for one token
                assert len(r.prompt) >= min(
                    sched.max_model_len, len(r.prompt) + r.sampling.max_tokens
                )
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    check_block_manager(bm)

    # Admission in key order, among the requests that had arrived and were not aborted.
    for q, tq in ev.admitted.items():
        for r, kr in ev.keys.items():
            if r == q or not kr < ev.keys[q] or ev.added[r] > tq:
                continue
            if r in ev.aborted and ev.aborted[r] < tq and r not in ev.admitted:
                continue
            assert r in ev.admitted and ev.admitted[r] <= tq, (r, q)

    # The no-starvation bounds that follow, stated in arrival times.
    arrival = {r.request_id: r.arrival for r in reqs}
    if isinstance(policy, SJF | EDF):
        for r, tr in ev.admitted.items():
            seq = ev.seqs[r]
            if isinstance(policy, SJF):
                bound = seq.arrival_time + seq.token_limit / policy.aging_rate
            else:
                bound = policy.deadline(seq)
            for q, tq in ev.admitted.items():
                if arrival[q] > bound:
                    assert tq >= tr, f"{q} arrived after {r}'s bound {bound} but went first"
