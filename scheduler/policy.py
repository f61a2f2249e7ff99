"""Scheduling policies: who is served first, who is preempted, who may displace whom.

A policy is a small object with one required method, `key`: the scheduler
keeps its waiting queue sorted by it (lowest first), gives the step's token
budget to prefill chunks and admissions in its order (after the running
decodes), and, when KV blocks run out, preempts the running request with the
highest key. The optional hooks:

- `may_preempt(req, victim)`: a waiting `req` that cannot be admitted (no
  blocks, or `max_num_seqs` reached) may preempt the running `victim`.
  Off by default; it must be a strict order (never both ways), or two
  requests could preempt each other forever.
- `begin_step` / `can_admit`: hold admissions back (static batching).
- `dynamic` / `refresh(now)`: for keys that change with time; the queue is
  then re-sorted every step. No policy here needs it: aging and deadlines are
  written as keys that do not move (see `SJF` and `EDF`).

Starvation. Admission follows the key strictly: a waiting request that does
not fit stops admission for the step rather than let a later key overtake it
(only a preempted request whose last token is still in flight is passed over,
for that step). In `sjf` and `edf` a key
grows with the arrival time and exceeds any earlier request's key after a
bounded delay, so a request can only be overtaken by requests that arrive
within a bounded time after it (the bound is in each class's docstring, and
`tests/test_scheduler_props.py` checks it).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from typing import Any

from subway.scheduler.request import Request


class Policy:
    name = "base"
    dynamic = False  # keys depend on time: re-sort the waiting queue every step
    preemptive = False  # may_preempt can be true

    def key(self, req: Request) -> Any:
        """Sort key: lower is served first (and preempted last). Must not change while the
        request is queued, unless `dynamic`."""
        raise NotImplementedError

    def refresh(self, now: float) -> None:
        """Called once per step before sorting when `dynamic` (to fix `now` for the keys)."""

    def pick_victim(self, candidates: Iterable[Request]) -> Request:
        """The running request to preempt when blocks run out: the one served last."""
        return max(candidates, key=self.key)

    def may_preempt(self, req: Request, victim: Request) -> bool:
        """Whether waiting `req` may preempt running `victim` to be admitted."""
        return False

    def begin_step(self, waiting: list[Request], num_running: int, max_num_seqs: int) -> None:
        """Called at the start of each step, before anything is scheduled."""

    def can_admit(self, req: Request) -> bool:
        """Whether waiting `req` may be admitted now (skipped, not blocking, if not)."""
        return True


class FCFS(Policy):
    """First come, first served, by arrival at the scheduler (seq ids are given in that order)."""

    name = "fcfs"

    def __init__(self) -> None:
        self.key = operator.attrgetter("seq_id")


class Priority(Policy):
    """Lower `priority` first (as in vLLM), then arrival. A waiting request may preempt
    running ones of a strictly higher (worse) priority value when blocks or seats are short.
    Strict: low priorities can wait as long as higher ones keep coming."""

    name = "priority"
    preemptive = True

    def __init__(self) -> None:
        self.key = operator.attrgetter("priority", "seq_id")

    def may_preempt(self, req: Request, victim: Request) -> bool:
        return victim.priority > req.priority


class SJF(Policy):
    """Shortest expected job first, with aging.

    A job's expected size is its prompt length plus `max_tokens` (capped by
    the model length): `req.token_limit` tokens. Waiting ages a job by
    `aging_rate` tokens per second: at time t its effective size is
    `size - aging_rate * (t - arrival)`. Every waiting job ages at the same
    rate, so the order never changes while they wait, and the key can be the
    constant `size + aging_rate * arrival`.

    Bound: a job of size L arriving at a is never overtaken by a job that
    arrives after `a + L / aging_rate` (whose key is larger whatever its size).
    """

    name = "sjf"

    def __init__(self, aging_rate: float = 200.0) -> None:
        if aging_rate <= 0:
            raise ValueError("aging_rate must be positive (or jobs could wait forever)")
        self.aging_rate = aging_rate

    def key(self, req: Request) -> tuple[float, int]:
        return (req.token_limit + self.aging_rate * req.arrival_time, req.seq_id)


class EDF(Policy):
    """Earliest (TTFT) deadline first, with two classes.

    A request's deadline is its arrival time plus its `slo_ttft_ms`, or, when
    it has none, plus its class's default: `interactive_ttft_ms` for
    `interactive`, `batch_ttft_ms` for `batch`. Interactive requests are
    protected: a waiting interactive request may preempt a running batch one
    with a later deadline when blocks or seats are short; batch requests fill
    what is left. A batch request is never starved: its deadline is fixed,
    so once new interactive arrivals have later deadlines than its own, it
    goes first and no longer yields its seat.

    Bound: a request with deadline D is never overtaken by one that arrives
    after D (whose deadline is later, as every SLO is positive).
    """

    name = "edf"
    preemptive = True

    def __init__(self, interactive_ttft_ms: float = 1000.0, batch_ttft_ms: float = 60000.0) -> None:
        if interactive_ttft_ms <= 0 or batch_ttft_ms <= 0:
            raise ValueError("default SLOs must be positive")
        self.interactive_ttft_ms = interactive_ttft_ms
        self.batch_ttft_ms = batch_ttft_ms

    def deadline(self, req: Request) -> float:
        slo = req.slo_ttft_ms
        if slo is None or slo <= 0:
            slo = self.batch_ttft_ms if req.slo_class == "batch" else self.interactive_ttft_ms
        return req.arrival_time + slo / 1000.0

    def key(self, req: Request) -> tuple[float, int]:
        return (self.deadline(req), req.seq_id)

    def may_preempt(self, req: Request, victim: Request) -> bool:
        return (
            victim.slo_class == "batch"
            and req.slo_class != "batch"
            and self.key(victim) > self.key(req)
        )


class Static(Policy):
    """Classic static batching, the baseline: a batch (the first `max_num_seqs` waiting
    requests) is formed when nothing runs, and nobody else is admitted until every member
    has finished. Members that are preempted may come back while their batch runs.

    `window_s`: as static-batching servers do, wait up to this long after the first
    request arrives at an idle engine for the batch to fill (0: form it at once).
    """

    name = "static"

    def __init__(self, window_s: float = 0.0) -> None:
        self.key = operator.attrgetter("seq_id")
        self.members: set[int] = set()
        self.window_s = window_s
        self._idle_since: float | None = None

    def begin_step(self, waiting: list[Request], num_running: int, max_num_seqs: int) -> None:
        if num_running or not waiting or (self.members and any(
            s.seq_id in self.members for s in waiting
        )):  # fmt: skip
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if len(waiting) >= max_num_seqs or now - self._idle_since >= self.window_s:
            self.members = {s.seq_id for s in waiting[:max_num_seqs]}
            self._idle_since = None

    def can_admit(self, req: Request) -> bool:
        return req.seq_id in self.members


POLICIES: dict[str, type[Policy]] = {
    "fcfs": FCFS,
    "priority": Priority,
    "sjf": SJF,
    "edf": EDF,
    "static": Static,
}


def policy_options(config) -> dict[str, Any]:
    """The options a policy takes from the engine's configuration."""
    if config.scheduler.policy == "static":
        return {"window_s": config.scheduler.static_batch_window_ms / 1000.0}
    return {}


def make_policy(name: str, **options: Any) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**options)
