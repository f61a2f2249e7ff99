"""The scheduler process on its worst day: forged and malformed messages, a hung worker, a
failed step, a stray connection, a dead frontend, SIGTERM. Over real sockets, with a fake
frontend and a fake rank-0 worker around the scheduler subprocess (`Rig`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from test_scheduler import EOS, VOCAB, FakeWorker, Rig, rig_dir  # noqa: F401 (a fixture)

from subway.ipc.messages import (
    AddRequest,
    Deltas,
    EngineError,
    EngineReady,
    FrontendHello,
    Plan,
    SamplingParams,
    Shutdown,
    StepResult,
    TokenRef,
    WorkerReady,
)
from subway.ipc.shm import resolve
from subway.ipc.sockets import connect

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


class Engine:
    """A Rig made ready, with a fake worker that answers plans when asked."""

    def __init__(self, rig: Rig, hello_pid: int | None = None, **hello) -> None:
        self.rig = rig
        self.worker = FakeWorker(64, 4)
        self.deltas: dict[str, list] = {}
        self.stats = None
        self.errors: list[str] = []
        self.plans: list[Plan] = []
        self.shutdowns: list[Shutdown] = []
        ready = WorkerReady(
            rank=0, pid=os.getpid(), num_blocks=64, max_model_len=128, vocab_size=VOCAB,
            eos_token_ids=[EOS], sampled_shm=rig.config.ipc.sampled_shm_name,
        )  # fmt: skip
        self.send_worker(ready)
        pid = os.getpid() if hello_pid is None else hello_pid
        self.send_frontend(FrontendHello(pid=pid, **hello))
        assert isinstance(rig.frontend_recv(), EngineReady)

    def send_worker(self, msg) -> None:
        self.rig.w_push.send(self.rig.from_worker.encoder.encode(msg))

    def send_frontend(self, msg) -> None:
        self.rig.fe_push.send(self.rig.to_sched.encode(msg))

    def add(self, rid: str, prompt: list[int], sp: SamplingParams = LONG) -> None:
        self.send_frontend(
            AddRequest(rid, TokenRef(ids=prompt), len(prompt), sp, arrival_time=time.time())
        )

    def answer(self, plan: Plan) -> None:
        for ns in plan.new_seqs:
            ns.prompt = TokenRef(ids=resolve(ns.prompt, self.rig.prompts))
        result, tokens = self.worker.run(plan)
        result.tokens = TokenRef(ids=tokens)
        self.send_worker(result)

    def pump(self, until, answer: bool = True, timeout: float = 20.0) -> None:
        """Answer plans and read deltas until `until()` or the deadline (then fail)."""
        deadline = time.monotonic() + timeout
        rig = self.rig
        while not until():
            assert time.monotonic() < deadline, "timed out"
            if rig.w_sub.poll(0):
                plan = rig.worker_recv()
                if isinstance(plan, Plan):
                    self.plans.append(plan)
                    if answer:
                        self.answer(plan)
                elif isinstance(plan, Shutdown):
                    self.shutdowns.append(plan)
            if rig.fe_pull.poll(5):
                msg = rig.frontend_recv()
                if isinstance(msg, Deltas):
                    self.stats = msg.stats or self.stats
                    for d in msg.deltas:
                        self.deltas.setdefault(d.request_id, []).append(d)
                elif isinstance(msg, EngineError):
                    self.errors.append(msg.message)

    def finish(self, rid: str) -> str | None:
        got = self.deltas.get(rid, [])
        return got[-1].finish_reason if got else None

    def num_tokens(self, rid: str) -> int:
        return sum(len(d.token_ids) for d in self.deltas.get(rid, []))


@pytest.fixture
def engine(rig_dir):  # noqa: F811
    rig = Rig(rig_dir, overlap=True)
    try:
        yield Engine(rig)
    finally:
        rig.close()


def test_malformed_and_forged_messages_are_refused_counted_and_survived(engine):
    rig = engine.rig
    rig.fe_push.send(b"\xc1garbage")  # undecodable
    engine.add("bad-vocab", [1, VOCAB + 7])  # a prompt id outside the vocabulary
    bad_ref = AddRequest("bad-ref", TokenRef(offset=1020, length=50), 50, LONG, time.time())
    engine.send_frontend(bad_ref)  # a run past the end of the prompt buffer
    bad_sp = AddRequest("bad-sp", TokenRef(ids=[1, 2]), 2, SamplingParams(top_p=7.0), time.time())
    engine.send_frontend(bad_sp)
    engine.pump(lambda: all(engine.finish(r) for r in ("bad-vocab", "bad-ref", "bad-sp")))
    assert {engine.finish(r) for r in ("bad-vocab", "bad-ref", "bad-sp")} == {"error"}
    # From the worker's side: a result for a step not in flight, one with a token id outside
    # the vocabulary, one naming sequences its plan never sampled, and garbage.
    engine.add("good", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.pump(lambda: engine.plans, answer=False)
    plan = engine.plans[0]
    sid = plan.seqs[0].seq_id
    forged = [
        StepResult(plan.step + 5, [sid], TokenRef(ids=[1])),
        StepResult(plan.step, [sid], TokenRef(ids=[VOCAB + 1])),
        StepResult(plan.step, [sid + 100], TokenRef(ids=[1])),
        StepResult(plan.step, [sid], TokenRef(offset=10**9, length=1)),
    ]
    for msg in forged:
        engine.send_worker(msg)
    rig.w_push.send(b"\x92\x01")
    engine.answer(plan)  # the true answer still settles the step
    engine.pump(lambda: engine.finish("good"))
    assert engine.finish("good") == "length" and engine.num_tokens("good") == 5
    engine.pump(lambda: engine.stats is not None and engine.stats.ipc_rejected_total >= 9)
    assert engine.stats.ipc_rejected_total == 9  # 4 from the frontend's side, 5 the worker's
    assert rig.proc.poll() is None and not engine.errors


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engine):
    engine.add("doomed", [1, 2, 3])
    engine.pump(lambda: engine.plans, answer=False)
    plan = engine.plans[0]
    failed = [s.seq_id for s in plan.seqs]
    engine.worker.run(plan)  # the fake keeps its state; later plans list the sequence finished
    engine.send_worker(StepResult(plan.step, [], TokenRef(ids=[]), failed=failed, error="boom"))
    engine.pump(lambda: engine.finish("doomed"))
    assert engine.finish("doomed") == "error"
    engine.add("after", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.pump(lambda: engine.finish("after"))
    assert engine.finish("after") == "length" and engine.num_tokens("after") == 4
    assert any(failed[0] in p.finished for p in engine.plans)  # the worker is told to forget it
    engine.pump(lambda: engine.stats.num_running == 0 and engine.stats.kv_blocks_used == 0)
    assert not engine.errors


def test_a_hung_worker_is_detected_within_the_step_timeout(rig_dir):  # noqa: F811
    rig = Rig(rig_dir, overlap=True, step_timeout=1.0)
    try:
        engine = Engine(rig)
        engine.add("stuck", [1, 2, 3])
        engine.pump(lambda: engine.plans, answer=False)
        sent = time.monotonic()
        engine.pump(lambda: engine.errors, answer=False, timeout=10)
        waited = time.monotonic() - sent
        assert "no progress" in engine.errors[0] and "step-timeout" in engine.errors[0]
        assert 0.8 <= waited < 4.0
        assert rig.proc.wait(timeout=10) == 1
    finally:
        rig.close()


def test_a_stray_connection_does_not_abort_anything(engine):
    """A peer that connects to the scheduler's request socket and leaves (a port probe, a
    load balancer) is not the frontend: nothing is aborted."""
    rig = engine.rig
    engine.add("r", [1, 2, 3])
    engine.pump(lambda: engine.num_tokens("r") >= 2)
    for _ in range(3):
        stray = connect(rig.ctx, zmq.PUSH, rig.config.ipc.scheduler_addr)
        stray.send(b"")  # completes the handshake, then goes
        stray.close(linger=100)
    engine.pump(lambda: engine.finish("r"))
    assert engine.finish("r") == "length" and engine.num_tokens("r") == 40


def test_the_frontend_is_judged_by_its_pid(rig_dir):  # noqa: F811
    """When the hello's process has died, a disconnect aborts its requests."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rig = Rig(rig_dir, overlap=True)
    try:
        engine = Engine(rig, hello_pid=stand_in.pid)
        engine.add("orphan", [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True))
        engine.pump(lambda: engine.num_tokens("orphan") >= 1)
        stand_in.kill()
        stand_in.wait()
        rig.fe_push.close(linger=0)  # the frontend's connection goes with it
        engine.pump(lambda: engine.finish("orphan"))
        assert engine.finish("orphan") == "abort" and engine.num_tokens("orphan") < 120
    finally:
        stand_in.kill()
        rig.close()


def test_sigterm_drains_what_is_in_flight(engine):
    rig = engine.rig
    engine.add("r", [1, 2, 3])
    engine.pump(lambda: engine.num_tokens("r") >= 1)
    rig.proc.send_signal(signal.SIGTERM)
    # Every plan is answered until the scheduler says Shutdown: it serves on meanwhile.
    engine.pump(lambda: engine.shutdowns)
    engine.pump(lambda: engine.finish("r"), timeout=2)
    assert engine.finish("r") == "length" and engine.num_tokens("r") == 40
    assert rig.proc.wait(timeout=10) == 0


def test_a_new_frontend_buffer_reaches_the_workers(engine):
    engine.send_frontend(FrontendHello(pid=os.getpid(), prompt_shm="subway_x_prompts_new"))
    engine.pump(lambda: True)
    engine.add("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.pump(lambda: engine.finish("r"))
    assert engine.plans[0].prompt_shm == "subway_x_prompts_new"
    assert all(not p.prompt_shm for p in engine.plans[1:])


def test_step_results_decode_only_as_their_type():
    """The worker's union refuses a frontend's message: each direction decodes its own."""
    from subway.ipc.messages import Codec, FromWorker, ToScheduler

    with pytest.raises(msgspec.ValidationError):
        Codec(FromWorker).decode(Codec(ToScheduler).encode(FrontendHello(pid=1)))
