"""What the planner (`planner.py`) reads of the scheduler that owns the queues, and the
outcome of one plan that it hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from subway.ipc.messages import NewSeq, SeqStep
from subway.scheduler.block_manager import BlockManager
from subway.scheduler.lora import LoraTable
from subway.scheduler.policy import Policy
from subway.scheduler.request import Request
from subway.scheduler.slo import StepCost
from subway.scheduler.speculative import SpeculativeConfig
from subway.scheduler.stats import SchedulerStats


class Queues(Protocol):
    """What the planner reads of the scheduler that owns the queues, and the scheduler's
    rules it calls while a plan is built (`scheduler.Scheduler` is the one owner)."""

    waiting: list[Request]
    running: list[Request]
    block_manager: BlockManager
    loras: LoraTable
    policy: Policy
    stats: SchedulerStats
    step_cost: StepCost
    speculative: SpeculativeConfig | None
    caching: bool
    num_interactive: int

    @property
    def num_running(self) -> int: ...

    def clock(self) -> float: ...

    def mark_running(self, req: Request) -> None: ...

    def preempt(self, req: Request) -> None: ...

    def cache_blocks(self, req: Request, upto: int) -> None: ...


@dataclass(slots=True)
class Planned:
    """One plan's outcome, for the scheduler to apply: the steps and new sequences it
    sends, the waiting requests it admitted (the first `num_admitted` of the queue, unless
    `scattered`: then those no longer waiting), and the requests it preempted (to queue
    again once the plan is built, so that none is re-admitted in it)."""

    steps: list[SeqStep] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    num_admitted: int = 0
    scattered: bool = False
    requeue: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    decode_kv: int = 0  # the context the decodes read (for the step cost model)
    decode_tokens: int = 0  # the decodes' tokens, drafts included (the same)
    capped: bool = False  # the policy's cap cut a batch chunk
    pool_limited: bool = False  # --pooling-share cut a pooled prompt's chunk (or left it out)
