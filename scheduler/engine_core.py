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
    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int = 2) -> None:
        if depth not in (1, 2):
            raise ValueError(f"overlap depth {depth}: 1 (synchronous) or 2 (overlapped)")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self._sent: deque[float] = deque()  # perf_counter() when each plan in flight left
        self._last_result_at = 0.0

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
            now = time.perf_counter()
            sent = self._sent.popleft() if self._sent else now
            sched.stats.last_step_time = now - max(sent, self._last_result_at)
            self._last_result_at = now
            deltas += sched.process_result(result, tokens)
        if sched.has_pending_deltas:
            deltas += sched.pop_pending_deltas()
        return deltas

    def plan(self) -> int:
        """Plan and submit while fewer than `depth` plans are in flight; how many went."""
        sched = self.scheduler
        n = 0
        while sched.num_inflight_plans < self.depth:
            plan = sched.schedule()
            if plan is None:
                break
            self.executor.submit(plan)
            self._sent.append(time.perf_counter())
            n += 1
        return n

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
