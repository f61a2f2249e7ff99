"""The worker process against a fake scheduler: ready, plans, results through shm, exits."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

import pytest
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    Codec,
    FromWorker,
    NewSeq,
    Plan,
    SamplingParams,
    SeqStep,
    Shutdown,
    StepResult,
    TokenRef,
    ToWorker,
    WorkerReady,
)
from subway.ipc.shm import TokenBuffer
from subway.ipc.sockets import bind

GREEDY = SamplingParams(temperature=0.0)
TIMEOUT_MS = 120_000


def _worker_main(config_json: str, rank: int) -> None:
    from subway.worker.process import run_worker

    sys.exit(run_worker(EngineConfig.from_json(config_json), rank))


class FakeScheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.ctx = zmq.Context()
        self.xpub = bind(self.ctx, zmq.XPUB, config.ipc.plan_addr)
        self.pull = bind(self.ctx, zmq.PULL, config.ipc.result_addr)
        self.codec_out, self.codec_in = Codec(ToWorker), Codec(FromWorker)

    def recv(self):
        assert self.pull.poll(TIMEOUT_MS), "no message from the worker"
        return self.codec_in.decode(self.pull.recv())

    def send(self, msg) -> None:
        self.xpub.send(self.codec_out.encode(msg))

    def wait_subscribed(self) -> None:
        assert self.xpub.poll(TIMEOUT_MS), "the worker never subscribed"
        assert self.xpub.recv()[:1] == b"\x01"

    def close(self) -> None:
        self.xpub.close()
        self.pull.close()
        self.ctx.term()


@pytest.fixture
def worker(tiny_models, tmp_path):
    config = EngineConfig.build(
        path=tiny_models["llama"], num_kv_blocks=64, block_size=4, threads=1, max_num_seqs=4,
        run_dir=str(tmp_path),
    )  # fmt: skip
    sched = FakeScheduler(config)
    prompts = TokenBuffer.create(config.ipc.prompt_shm_name, 1024)
    proc = mp.get_context("spawn").Process(target=_worker_main, args=(config.to_json(), 0))
    proc.start()
    try:
        sched.wait_subscribed()
        ready = sched.recv()
        assert isinstance(ready, WorkerReady), ready
        yield config, sched, prompts, proc, ready
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        prompts.close()
        sched.close()


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_plans_results_and_shutdown(worker):
    from subway.worker.runner import ModelRunner

    config, sched, prompts, proc, ready = worker
    assert (
        ready.rank == 0
        and ready.num_blocks == 64
        and ready.sampled_shm == config.ipc.sampled_shm_name
    )
    assert ready.vocab_size > 0 and ready.max_model_len == 2048
    sampled = TokenBuffer.attach(ready.sampled_shm)
    prompt = [5, 17, 300, 42, 9, 1000]
    prompts.write(100, prompt)
    plans = [
        Plan(0, [SeqStep(0, 0, 6, [3, 7])], [NewSeq(0, TokenRef(100, 6), GREEDY)]),
        Plan(1, [SeqStep(0, 6, 1)], [NewSeq(1, TokenRef(ids=[8, 9, 10]), GREEDY)]),
        Plan(2, [SeqStep(0, 7, 1), SeqStep(1, 0, 3, [1])]),
        Plan(3, [SeqStep(0, 8, 1, [2]), SeqStep(1, 3, 1, [4])]),
    ]
    got = []
    for plan in plans:
        sched.send(plan)
        res = sched.recv()
        assert isinstance(res, StepResult) and res.step == plan.step
        assert res.tokens.ids is None and res.forward_time > 0
        assert res.tokens.offset == (plan.step % 8) * config.scheduler.max_num_seqs
        got.append((res.seq_ids, sampled.read(res.tokens.offset, res.tokens.length).tolist()))
    sampled.close()
    # The same plans in this process give the same tokens.
    local = ModelRunner(config.replace(use_shm=False))
    local._prompts = prompts
    expected = []
    for plan in plans:
        out = local.execute(plan)
        expected.append((out.seq_ids, out.tokens))
    local._prompts = None
    assert got == expected
    sched.send(Shutdown())
    proc.join(60)
    assert proc.exitcode == 0
    assert not _shm_exists(config.ipc.sampled_shm_name)


def _result(sched: FakeScheduler) -> StepResult:
    res = sched.recv()
    assert isinstance(res, StepResult), res
    return res


def test_a_failed_step_fails_its_requests_and_the_worker_serves_on(worker):
    """A plan the worker cannot run (an unknown sequence, a prompt id outside the vocabulary,
    positions past its blocks) fails only its own sequences; a malformed plan is refused and
    counted; the next good plan is served."""
    config, sched, _, proc, ready = worker
    sched.send(Plan(0, [SeqStep(99, 0, 1, [0])]))  # a sequence the worker never saw
    res = _result(sched)
    assert res.step == 0 and res.failed == [99] and "99" in res.error and not res.seq_ids
    bad_ids = TokenRef(ids=[1, ready.vocab_size + 5])
    sched.send(Plan(1, [SeqStep(1, 0, 2, [0])], [NewSeq(1, bad_ids, GREEDY)]))
    res = _result(sched)
    assert res.failed == [1] and "vocabulary" in res.error.lower() or "outside" in res.error
    sched.xpub.send(b"\x93not a plan")  # undecodable: refused, counted, not fatal
    good = TokenRef(ids=[5, 6, 7])
    sched.send(Plan(2, [SeqStep(2, 0, 3, [1]), SeqStep(3, 0, 9, [2])],
                    [NewSeq(2, good, GREEDY), NewSeq(3, good, GREEDY)]))  # fmt: skip
    res = _result(sched)  # seq 3 asks past its 3 tokens: the step fails for both
    assert res.failed == [2, 3] and res.rejected_total == 1
    # A step planned before the scheduler saw the failure skips the failed sequences.
    sched.send(Plan(3, [SeqStep(2, 3, 1), SeqStep(4, 0, 3, [3])], [NewSeq(4, good, GREEDY)]))
    res = _result(sched)
    assert res.seq_ids == [4] and len(res.tokens.ids or [0]) == 1 and not res.failed
    sched.send(Plan(4, [SeqStep(4, 3, 1)], finished=[2, 3]))
    res = _result(sched)
    assert res.seq_ids == [4]
    assert proc.is_alive()
    sched.send(Shutdown())
    proc.join(60)
    assert proc.exitcode == 0


def test_sigterm_drains_until_shutdown(worker):
    """SIGTERM alone does not stop a worker: it serves plans until the scheduler's Shutdown
    (systemd signals every process at once; the scheduler drains first)."""
    config, sched, _, proc, _ = worker
    os.kill(proc.pid, signal.SIGTERM)
    sched.send(Plan(0, [SeqStep(0, 0, 3, [0])], [NewSeq(0, TokenRef(ids=[5, 6, 7]), GREEDY)]))
    res = _result(sched)
    assert res.seq_ids == [0] and not res.failed
    sched.send(Shutdown())
    proc.join(60)
    assert proc.exitcode == 0
    assert not _shm_exists(config.ipc.sampled_shm_name)


def test_sigint_after_sigterm_exits_at_once(worker):
    """A second SIGTERM changes nothing (systemd and the launcher may both send one); a
    SIGINT after it (Ctrl-C) stops the worker without waiting for the scheduler."""
    config, sched, _, proc, _ = worker
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGTERM)
    sched.send(Plan(0, [SeqStep(0, 0, 3, [0])], [NewSeq(0, TokenRef(ids=[5, 6, 7]), GREEDY)]))
    assert _result(sched).seq_ids == [0]  # still serving
    os.kill(proc.pid, signal.SIGINT)
    proc.join(60)
    assert proc.exitcode == 0
    assert not _shm_exists(config.ipc.sampled_shm_name)


def test_the_memory_profile_covers_every_logit_row_a_step_can_ask():
    """`echo` + `logprobs` ask a logit row per prompt position: the CUDA memory profile
    must size for the most rows any step within the token budget can compute."""
    import random

    import numpy as np

    from subway.worker.kv_pages import logit_rows_worst_case
    from subway.worker.prompt_logprobs import PromptLogprobTracker

    config = EngineConfig.build(max_num_batched_tokens=96, max_num_seqs=8)
    budget = config.scheduler.max_num_batched_tokens
    bound = logit_rows_worst_case(config.scheduler, max_model_len=4096)
    rng = random.Random(0)
    worst = 0
    for _ in range(300):
        tracker, steps, left = PromptLogprobTracker(), [], budget
        for sid in range(rng.randint(1, config.scheduler.max_num_seqs)):
            if left == 0:
                break
            prompt_len = rng.randint(2, 300)
            start = rng.randrange(prompt_len)
            n = min(left, rng.randint(1, prompt_len - start))
            left -= n
            sample = start + n == prompt_len  # a last chunk samples
            if rng.random() < 0.8:
                tracker.add(sid, SamplingParams(prompt_logprobs=1), prompt_len)
            steps.append(SeqStep(sid, start, n, sample=sample))
        qlens = np.array([s.num_tokens for s in steps])
        idx, _ = tracker.rows(steps, qlens)
        worst = max(worst, len(idx) + sum(s.sample for s in steps))
    assert worst <= bound
    assert worst > budget * 0.9  # the random steps came near the bound: the check bites
