"""An executor that checks nothing and answers every plan at once: for timing the scheduler."""

from __future__ import annotations

from collections import deque

from subway.ipc.messages import Plan, StepResult, TokenRef


class NullWorker:
    """Answers every plan with a fixed token for each sampling sequence."""

    def __init__(self, token: int = 7) -> None:
        self.token = token
        self.queued: deque[Plan] = deque()

    def submit(self, plan: Plan) -> None:
        self.queued.append(plan)

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        return [self.run(self.queued.popleft())] if self.queued else []

    def run(self, plan: Plan) -> tuple[StepResult, list[int]]:
        ids = [s.seq_id for s in plan.seqs if s.sample]
        tokens = [self.token] * len(ids)
        return StepResult(step=plan.step, seq_ids=ids, tokens=TokenRef(ids=tokens)), tokens
