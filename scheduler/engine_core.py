"""The step loop, written once: settle results, then plan, through an `Executor`.

`EngineCore` drives a `Scheduler` and an executor that runs its plans. Each
turn settles every result the executor has ready (in plan order), then plans
while fewer than `depth` plans are in flight: depth 1 is synchronous (plan N+1
only after result N), depth 2 overlaps (plan N+1 while N runs; see
`planner.py` for what that assumes and how it is settled).

Executors:

- the worker processes (`scheduler/worker_link.py`): `submit` publishes the
  plan, `collect` returns the results that have arrived;
- an in-process model runner (`subway.llm.InProcessExecutor`), for the
  offline `LLM`, benchmarks and tests;
- test doubles (a fake worker that checks every plan, a null one for timing).

Late planning (`late_planning`, the scheduler process's default with
overlap): plan N+1 is made not as soon as N is sent but just before N should
end, by the scheduler's `StepCost` (at 85% of its predicted time, less the
time a plan takes to make), so that a request arriving while N runs joins N+1
instead of N+2: at light load that is one step less before its first token.
If N ends sooner, its result wakes the loop and N+1 is made at once (a step
without overlap). It waits only while a seat is free (else no arrival could
join), once the cost model has seen a few steps, and, given `wake_cost_s`,
while requests arrive often enough to pay for the wait. The wait is a second
wake of the scheduler each step; where CPU workers take every core, each
running sequence's step pays for that wake's CPU (on a 2-core EPYC, one
stream: 0.52 against 0.35 ms of scheduler CPU a token), while the wait gains a
step only for an arrival that lands in it. So it waits only while the
arrival rate of the last 2 s x the step's predicted time (arrivals caught) x
that time (what each gains) reaches `wake_cost_s` x the running sequences.
`wake_in()` tells the loop how long it may block.

An in-process executor (a `LazyExecutor`) runs nothing at `submit`: `collect`
runs its oldest plan and returns that one result, so an overlapped plan is made exactly as the
scheduler process makes it, before the result of the step before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from subway.ipc.messages import Plan, RequestDelta, StepResult
from subway.scheduler.scheduler import Scheduler


class Executor(Protocol):
    def submit(self, plan: Plan) -> None:
        """Start (or queue) a plan. Plans run in the order they are submitted."""

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        """Results ready now, oldest first: each with its sampled token ids."""


class LazyExecutor:
    """An executor that runs a plan only when asked for results: `collect` runs the oldest
    submitted plan and returns its one result. Subclasses give `run(plan)`."""

    def __init__(self) -> None:
        self.queued: deque[Plan] = deque()

    def submit(self, plan: Plan) -> None:
        self.queued.append(plan)

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        return [self.run(self.queued.popleft())] if self.queued else []

    def run(self, plan: Plan) -> tuple[StepResult, list[int]]:
        raise NotImplementedError


class EngineCore:
    LATE_FRACTION = 0.85  # of the step in flight's predicted time, when the next plan is made
    LATE_LEAD_S = 0.002  # and this much earlier, with twice the last plan's making time

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        depth: int = 2,
        late_planning: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        wake_cost_s: float = 0.0,
    ) -> None:
        """`wake_cost_s`: what a late plan's extra wake of the loop adds to each running
        sequence's step (0: nothing, where the loop has a core of its own)."""
        if depth not in (1, 2):
            raise ValueError(f"overlap depth {depth}: 1 (synchronous) or 2 (overlapped)")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.late_planning = late_planning and depth == 2
        self.clock = clock
        self.wake_cost_s = wake_cost_s
        # For each plan in flight: clock() when it left, the tokens it computes and the
        # context its decodes read (what `StepCost` predicts from).
        self._sent: deque[tuple[float, int, int, int]] = deque()
        self._last_result_at = 0.0
        self._plan_at: float | None = None  # late planning: when the next plan is due

    @property
    def idle(self) -> bool:
        """No plan in flight and no delta waiting to go out."""
        sched = self.scheduler
        return not sched.num_inflight_plans and not sched.has_pending_deltas

    def step(self) -> list[RequestDelta]:
        """One turn: settle what is ready, then plan; the turn's deltas."""
        deltas = self.settle()
        self.plan()
        return deltas

    def settle(self) -> list[RequestDelta]:
        """Settle every result the executor has ready; with the deltas no result carries."""
        sched = self.scheduler
        deltas: list[RequestDelta] = []
        for result, tokens in self.executor.collect():
            now = self.clock()
            sent, num_tokens, kv, decodes = self._sent.popleft() if self._sent else (now, 0, 0, 0)
            step_time = now - max(sent, self._last_result_at)
            sched.stats.last_step_time = step_time
            sched.stats.last_predicted_step_time = sched.step_cost.predict(num_tokens, kv, decodes)
            sched.step_cost.observe(num_tokens, step_time, kv, decodes)
            self._last_result_at = now
            deltas += sched.process_result(result, tokens)
        if sched.has_pending_deltas:
            deltas += sched.pop_pending_deltas()
        return deltas

    def plan(self) -> int:
        """Plan and submit while fewer than `depth` plans are in flight; how many went."""
        sched = self.scheduler
        n = 0
        self._plan_at = None
        while sched.num_inflight_plans < self.depth:
            if self.late_planning and sched.num_inflight_plans:
                due = self._due()
                if due is not None and self.clock() < due:
                    self._plan_at = due
                    break
            plan = sched.schedule()
            if plan is None:
                break
            self.executor.submit(plan)
            stats = sched.stats
            self._sent.append((self.clock(), stats.last_num_batched_tokens, stats.last_decode_kv,
                               stats.last_num_decodes))  # fmt: skip
            n += 1
        return n

    def wake_in(self) -> float | None:
        """Seconds until a plan is due (late planning), or None if none waits on time."""
        return None if self._plan_at is None else max(0.0, self._plan_at - self.clock())

    def _due(self) -> float | None:
        """When to make the next plan while one runs (late planning); None: now."""
        sched = self.scheduler
        cost = sched.step_cost
        if not cost.ready or not self._sent or sched.num_running >= sched.max_num_seqs:
            return None
        sent, num_tokens, kv, decodes = self._sent[-1]
        predicted = cost.predict(num_tokens, kv, decodes)
        # The wait gains `predicted` for each arrival it catches (rate x predicted a step)
        # and costs each running sequence `wake_cost_s` a step.
        if sched.arrival_rate() * predicted**2 < self.wake_cost_s * max(1, sched.num_running):
            return None  # arrivals too rare to pay for the wake
        started = max(sent, self._last_result_at)
        lead = self.LATE_LEAD_S + 2.0 * sched.stats.last_schedule_time
        return started + self.LATE_FRACTION * predicted - lead

    def run(
        self,
        on_deltas: Callable[[list[RequestDelta]], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Step until no work is left (with an executor that never waits, as in-process
        ones), or until `stop()` says so (then False). `on_deltas` sees each turn's deltas
        before the turn plans, so an abort it makes reaches the next plan."""
        sched = self.scheduler
        while True:
            deltas = self.settle()
            if deltas and on_deltas is not None:
                on_deltas(deltas)
            self.plan()
            if self.idle:
                if sched.has_work:
                    raise RuntimeError("the scheduler has work but planned nothing")
                return True
            if stop is not None and stop():
                return False
