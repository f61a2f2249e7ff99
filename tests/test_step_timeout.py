"""A hung worker is noticed in seconds, a slow step is not killed (issue 43).

The bound on a step's progress (`scheduler/worker_link.py`): by default max(10 s, 20 x
the step cost model's prediction for the plan), 20-23 s before the model has seen a
few steps, `--step-timeout` where given. Checked on a `WorkerLink` with a clock of the
test's, then black-box: a worker stopped under default flags fails its streams and
`serve` within 30 s; a stopped prefill engine (its worker, its scheduler) leaves its
requests to the decode engine, which serves them whole, in seconds.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import msgspec
import psutil
import pytest
import zmq
from test_liveness import Streams

from subway.ipc.config import EngineConfig
from subway.ipc.messages import Plan, SeqStep, WorkerReady
from subway.ipc.sockets import Sockets
from subway.scheduler.slo import StepCost
from subway.scheduler.worker_link import WorkerLink
from subway.tools.proc_title import parse

from serving import Server, complete, until

# `cold_bound` is imported where it is used, so that the served tests also run (and fail
# as they should) against a subway without it.

# ------------------------------------------------------------------ the rule, on a link


class Link:
    """A `WorkerLink` on sockets of its own, with a clock the test moves."""

    def __init__(self, run_dir: str, **flags) -> None:
        self.config = EngineConfig.build(run_dir=run_dir, run_id="st", **flags)
        self.ctx = zmq.Context()
        self.socks = Sockets(self.ctx, self.config.ipc)
        self.link = WorkerLink(self.socks, self.config)
        self.now = 1000.0
        self.link.clock = lambda: self.now
        self.link.started = True

    def submit(self, tokens_per_seq: list[int]) -> None:
        seqs = [SeqStep(i, 0, n) for i, n in enumerate(tokens_per_seq)]
        self.link.submit(Plan(0, seqs))

    def after(self, seconds: float) -> str | None:
        """The link's failure (None: none) `seconds` after the plan went out."""
        self.now += seconds
        self.link.drain()
        self.now -= seconds
        return self.link.failure

    def failed_at(self, within: float, tick: float = 0.25) -> float | None:
        """Seconds after the plan went out at which the link, drained every `tick`, said
        the workers hang; None if not within `within`."""
        start = self.now
        while self.now - start < within:
            self.now += tick
            self.link.drain()
            if self.link.failure is not None:
                return self.now - start
        return None

    def local_worker(self, signs, device: str = "cpu") -> None:
        """One rank-0 worker on this host, whose /proc reads `signs(t)` at time t."""
        ready = WorkerReady(rank=0, pid=os.getpid(), num_blocks=8, max_model_len=64,
                            vocab_size=100, eos_token_ids=[1], device=device)  # fmt: skip
        self.link.workers = {0: ready}
        self.link.work.read = lambda pid: signs(self.now)
        self.link.work.watch([ready])

    def close(self) -> None:
        self.link.close()
        self.socks.close()
        self.ctx.term()


@pytest.fixture
def make_link(tmp_path):
    made: list[Link] = []

    def make(**flags) -> Link:
        made.append(Link(str(tmp_path / f"r{len(made)}"), **flags))
        return made[-1]

    yield make
    for link in made:
        link.close()


def trained(seconds_per_token: float, base: float = 0.005) -> StepCost:
    """A cost model that has seen enough steps of `base + seconds_per_token x tokens`."""
    cost = StepCost()
    for tokens in (1, 4, 16, 64, 256, 512) * 3:
        cost.observe(tokens, base + seconds_per_token * tokens)
    assert cost.ready
    return cost


def test_a_warm_engine_declares_a_stopped_step_hung_at_the_ten_second_floor(make_link):
    t = make_link()
    t.link.step_cost = trained(1e-4)  # steps of milliseconds
    t.submit([1] * 8)
    assert t.after(9.9) is None
    failure = t.after(10.2)
    assert failure is not None and "hung" in failure and "--step-timeout" in failure


def test_a_step_predicted_slow_gets_twenty_times_its_prediction(make_link):
    """A long prefill chunk on a loaded CPU: 512 tokens at 4 ms each, about 2 s."""
    t = make_link()
    t.link.step_cost = trained(4e-3)
    t.submit([512])
    predicted = t.link.step_cost.predict(512, 512)
    assert 1.8 < predicted < 2.5
    assert t.after(19 * predicted) is None  # slow, not hung: never killed
    assert t.after(21 * predicted) is not None


def test_before_the_cost_model_is_ready_a_small_plan_is_bounded_under_30_s(make_link):
    t = make_link()
    assert t.link.step_cost is None  # no model yet: the first steps of a run
    t.submit([16] * 4)
    assert t.after(19.9) is None  # room for a first step's warm-up
    assert t.after(25.0) is not None
    t2 = make_link()
    t2.link.step_cost = StepCost()  # a model that has seen no step: the same bound
    t2.submit([512])
    assert t2.after(22.0) is None and t2.after(24.0) is not None
    from subway.scheduler.worker_link import cold_bound

    assert cold_bound(512, 512) < 30.0 < cold_bound(8192)  # a large first plan: more


def test_the_flag_overrides_the_adaptive_bound(make_link):
    t = make_link(step_timeout=3.0)
    t.link.step_cost = trained(4e-3)
    t.submit([512])
    assert t.after(2.9) is None
    failure = t.after(3.1)
    assert failure is not None and "--step-timeout 3" in failure


def test_a_cpu_worker_that_uses_no_cpu_is_hung_after_ten_seconds_whatever_its_prediction(
    make_link,
):
    """A machine so loaded that a 512-token step is predicted at 2 s (bound 40 s): a
    stopped worker (state T, its CPU time still) is declared after 10-11 s."""
    t = make_link()
    t.link.step_cost = trained(4e-3)
    t.local_worker(lambda now: (5000, "T"))
    t.submit([512])
    failed = t.failed_at(60)
    assert failed is not None and 10.0 < failed <= 11.5, failed
    assert "no worker has used CPU time" in t.link.failure and "hung" in t.link.failure


def test_a_slow_cpu_step_that_burns_cpu_gets_its_whole_bound(make_link):
    """The same step, its worker sleeping between bursts (state S) but using CPU time all
    along (3 ticks a second, as a worker given little of a loaded machine): only the
    adaptive bound, 20 x 2 s, ends it."""
    t = make_link()
    t.link.step_cost = trained(4e-3)
    t.local_worker(lambda now: (int(now * 3), "S"))
    t.submit([512])
    bound = 20 * t.link.step_cost.predict(512, 512)
    failed = t.failed_at(60)
    assert failed is not None and bound <= failed <= bound + 0.5, (failed, bound)


def test_a_first_step_that_is_visibly_working_is_not_cut_at_the_cold_bound(make_link):
    """The first steps of a run on a machine shared with other work: the worker computes
    (its CPU time grows) past the 20 s cold bound; it is given `COLD_BUSY_S`."""
    from subway.scheduler.worker_link import COLD_BUSY_S

    t = make_link()
    t.local_worker(lambda now: (int(now * 3), "S"))
    t.submit([16] * 4)
    assert t.failed_at(60) is None
    assert COLD_BUSY_S >= 300.0


def test_a_stopped_gpu_worker_in_its_first_steps_meets_the_cold_bound(make_link):
    """A CUDA worker may wait for its GPU without CPU time, so no sign of work is not
    proof of a hang there; but it is no sign of work either: the cold bound holds."""
    t = make_link()
    t.local_worker(lambda now: (5000, "T"), device="cuda")
    t.submit([16] * 4)
    failed = t.failed_at(60)
    assert failed is not None and 20.0 < failed <= 21.5, failed
    assert "a first step" in t.link.failure


def test_a_worker_stopped_while_its_engine_is_idle_is_declared_after_ten_seconds(make_link):
    """No plan in flight, so no step can time out: a worker seen stopped (state T) for
    10 s is a failure anyway (on 9c8d7d0 an idle prefill engine's stopped worker went
    unseen until the next request waited out a step's bound); an idle worker asleep
    (state S, no CPU time) is not."""
    t = make_link()
    t.local_worker(lambda now: (5000, "S"))
    assert t.failed_at(60) is None
    t.local_worker(lambda now: (5000, "T"))
    failed = t.failed_at(60)
    assert failed is not None and 10.0 <= failed <= 11.5, failed
    assert "stopped" in t.link.failure and "idle" in t.link.failure
    assert f"pid {os.getpid()}" in t.link.failure and "worker 0" in t.link.failure
    # A stopped worker whose /proc then cannot be read is no evidence any more.
    t2 = make_link()
    reads = iter([(5000, "T")] * 3)
    t2.local_worker(lambda now: next(reads, None))
    assert t2.failed_at(60) is None


def test_workers_elsewhere_give_no_evidence(make_link):
    t = make_link()
    ready = WorkerReady(rank=0, pid=1, num_blocks=8, max_model_len=64, vocab_size=100,
                        eos_token_ids=[1], device="cpu", host="elsewhere")  # fmt: skip
    t.link.work.watch([ready])
    assert (t.link.work.pids, t.link.work.cpu) == ([], False)
    t.link.work.watch([msgspec.structs.replace(ready, host="")])
    assert (t.link.work.pids, t.link.work.cpu) == ([1], True)
    t.link.work.watch([msgspec.structs.replace(ready, host="", device="cuda")])
    assert (t.link.work.pids, t.link.work.cpu) == ([1], False)


def test_the_default_flag_is_adaptive():
    assert EngineConfig().scheduler.step_timeout == 0.0


# ------------------------------------------------------------------ served


def _kill_all(server: Server, pids: list[int]) -> None:
    for p in pids:
        if psutil.pid_exists(p):
            psutil.Process(p).kill()
    server.stop()


@pytest.mark.slow
def test_a_stopped_worker_is_detected_within_30_s_with_default_flags(tiny_models):
    s = Server(tiny_models["llama"], "--num-kv-blocks", "256", "--max-model-len", "2048")
    pids = [c.pid for c in s.children()]
    try:
        streams = Streams(s.url, 2, 1900)
        until(lambda: s.metrics().get("subway:num_requests_running", 0) >= 1, 30)
        s.child("worker").suspend()  # SIGSTOP
        t0 = time.monotonic()
        streams.join(30)
        assert all(Streams.summary(r)[0] in ("error", "exception") for r in streams.results)
        assert s.proc.wait(max(1.0, 30 - (time.monotonic() - t0))) != 0
        assert time.monotonic() - t0 < 30
        assert "hung" in s.read_output()
    finally:
        _kill_all(s, pids)
    assert until(lambda: not s.shm_files(), 5) < 5


PD = ["--prefill-engines", "1", "--decode-engines", "1", "--threads", "1",
      "--max-num-batched-tokens", "24", "--block-size", "8", "--num-kv-blocks", "256"]  # fmt: skip
PROMPTS = [[(7 * i + 11 * j) % 900 + 20 for i in range(43)] for j in range(4)]


def _prefill(server: Server, kind: str) -> psutil.Process:
    return next(c for c in server.children()
                if parse(c.cmdline()).get("role") == "prefill"
                and parse(c.cmdline())["kind"] == kind)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("victim, within", [("worker", 30.0), ("scheduler", 20.0)])
def test_a_stopped_prefill_engine_leaves_its_requests_to_the_decode_engine(
    tiny_models, victim, within
):
    """Each prompt is served once through both engines (the prefill engine's cost model
    sees its steps), then the prefill engine's worker or scheduler is stopped and the
    same prompts are sent again: each must come back whole, with the same greedy tokens,
    within `within` seconds (the step bound for a worker; 7-8 s of heartbeat silence
    for a scheduler), not when a 300 s step timeout or a 30 s silence ends."""
    s = Server(tiny_models["llama"], *PD, whole=True)
    pids = [c.pid for c in s.children()]
    try:
        want = [complete(s.url, p, 8) for p in PROMPTS]
        _prefill(s, victim).suspend()  # SIGSTOP
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(s.url, p, 8), PROMPTS))
        took = time.monotonic() - t0
        assert got == want
        assert took < within, (took, s.read_output()[-3000:])
        assert s.proc.poll() is None  # the decode engine serves on
    finally:
        _kill_all(s, pids)
