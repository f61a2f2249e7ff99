"""The real scheduler and the real model runner in one process, without sockets.

For tests and benchmarks of the model path: the same Scheduler and ModelRunner
that `subway serve` runs in separate processes, stepped here in a loop. With
`overlap=True` the loop plans step N+1 before it hands result N to the
scheduler, exactly as the scheduler process does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from subway.ipc.config import EngineConfig
from subway.ipc.messages import AddRequest, SamplingParams, StepResult, TokenRef


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)


class OfflineEngine:
    def __init__(self, config: EngineConfig) -> None:
        from subway.scheduler.scheduler import Scheduler
        from subway.worker.runner import ModelRunner

        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(
            config, self.runner.num_blocks, self.runner.max_model_len, self.runner.eos_token_ids
        )
        self.steps = 0
        self._next_id = 0

    def add(self, prompt: list[int], sampling: SamplingParams, **extra) -> str:
        rid = f"r{self._next_id}"
        self._next_id += 1
        req = AddRequest(
            request_id=rid,
            prompt=TokenRef(ids=list(prompt)),
            prompt_len=len(prompt),
            sampling=sampling,
            arrival_time=time.time(),
            **extra,
        )
        self.scheduler.add(req, list(prompt))
        return rid

    def _result(self, plan, out) -> StepResult:
        return StepResult(
            step=plan.step,
            seq_ids=out.seq_ids,
            tokens=TokenRef(ids=out.tokens),
            logprobs=out.logprobs,
            top_ids=out.top_ids,
            top_logprobs=out.top_logprobs,
        )

    def run(
        self, outputs: dict[str, Output], overlap: bool = False, abort_after: dict | None = None
    ):
        """Step until no work is left, collecting deltas into `outputs` (request id -> Output)."""
        pending = None  # (plan, output) whose result the scheduler has not seen yet
        while True:
            plan = self.scheduler.schedule()
            if plan is None and pending is None and not self.scheduler.has_pending_deltas:
                if self.scheduler.has_work:
                    raise RuntimeError("the scheduler has work but planned nothing")
                return
            out = self.runner.execute(plan) if plan is not None else None
            if plan is not None:
                self.steps += 1
            done = pending if overlap else (plan, out)
            pending = (plan, out) if overlap and plan is not None else None
            deltas = self.scheduler.pop_pending_deltas()
            if done is not None and done[0] is not None:
                deltas += self.scheduler.process_result(self._result(*done), done[1].tokens)
            for d in deltas:
                o = outputs.setdefault(d.request_id, Output())
                o.token_ids += d.token_ids
                o.logprobs += d.logprobs or []
                o.top_ids += d.top_ids or []
                if d.finish_reason:
                    o.finish_reason = d.finish_reason
            if abort_after:
                for rid, n in list(abort_after.items()):
                    if len(outputs.get(rid, Output()).token_ids) >= n:
                        self.scheduler.abort(rid)
                        del abort_after[rid]

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, overlap: bool = False
    ) -> list[Output]:
        ids = [self.add(p, sampling) for p in prompts]
        outputs: dict[str, Output] = {}
        self.run(outputs, overlap=overlap)
        return [outputs.get(i, Output()) for i in ids]
