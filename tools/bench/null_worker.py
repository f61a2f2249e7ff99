"""An executor that checks nothing and answers every plan at once: for timing the scheduler."""

from __future__ import annotations

from subway.ipc.messages import Plan, StepResult, TokenRef
from subway.scheduler.engine_core import LazyExecutor


class NullWorker(LazyExecutor):
    """Answers every plan with a fixed token for each sampling sequence."""

    def __init__(self, token: int = 7) -> None:
        super().__init__()
        self.token = token

    def run(self, plan: Plan) -> tuple[StepResult, list[int]]:
        ids = [s.seq_id for s in plan.seqs if s.sample]
        tokens = [self.token] * len(ids)
        return StepResult(step=plan.step, seq_ids=ids, tokens=TokenRef(ids=tokens)), tokens
