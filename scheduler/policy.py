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
- `must_displace(req)` / `pick_displaced`: whether a waiting `req` that may
  preempt should (`edf`: only when waiting for a seat would miss its
  deadline), and whom (`edf`: the batch request with the least work to lose).
- `batch_chunk_cap()`: the most tokens a step may hold when a batch-class
  prefill chunk is added to it (`edf` with `--slo-tpot-ms`: the tokens a step
  can compute within the TPOT SLO while chats are live; None: no cap).
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

import math
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from subway.scheduler.request import Request, RequestStatus
from subway.scheduler.slo import StepCost
from subway.scheduler.stats import SchedulerStats


@dataclass(slots=True)
class StepView:
    """What a policy may read of the scheduler while one step's plan is made: given to
    `begin_step`, valid until the plan is built (the lists are the scheduler's own, read only)."""

    clock: Callable[[], float]
    waiting: list[Request]  # in policy order
    running: list[Request]  # may hold requests no longer running (check `status`)
    num_running: int  # at the start of the step
    num_interactive: int  # live requests not of the batch class
    max_num_seqs: int
    max_num_batched_tokens: int
    step_cost: StepCost
    stats: SchedulerStats


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

    def begin_step(self, view: StepView) -> None:
        """Called at the start of each step's plan, before anything is scheduled."""

    def must_displace(self, req: Request) -> bool:
        """Whether waiting `req`, which `may_preempt` some running request, should do it now
        rather than wait for a seat or blocks to free."""
        return True

    def pick_displaced(self, candidates: Iterable[Request]) -> Request:
        """Whom a waiting request displaces, among those `may_preempt` allows."""
        return self.pick_victim(candidates)

    def batch_chunk_cap(self, decode_tokens: int, decode_kv: int) -> int | None:
        """The most tokens this step, `decode_tokens` so far whose decodes read `decode_kv`
        of context, may hold once a batch-class prefill chunk joins it (None: no cap)."""
        return None

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
    """Earliest (TTFT) deadline first, with two classes, spending priority only as far as
    deadlines need it.

    A request's deadline is its arrival time plus its `slo_ttft_ms`, or, when
    it has none, plus its class's default: `interactive_ttft_ms` for
    `interactive`, `batch_ttft_ms` for `batch`. The queue and each step's
    budget follow the deadlines, so a chat's (short) prefill goes before batch
    chunks, and batch requests take the rest of the budget.

    Slack. A waiting chat that finds no seat (or no blocks) may preempt a
    running batch request with a later deadline, but only when waiting would
    miss its deadline: when its slack, the deadline less now, less the time
    until a running request should finish on its own, less its own expected
    time to a first token, is negative (times from the scheduler's `StepCost`).
    It then preempts the batch request with the fewest computed tokens (the
    least work to redo). Before the cost model has seen a few steps, chats
    preempt as soon as they find no room.

    TPOT. With `tpot_ms` (`--slo-tpot-ms`), while any chat is live (waiting
    or running), a step takes batch prefill chunks only up to the tokens that
    `StepCost` says fit in 0.8 x the step's time bound (its first batch chunk
    one block at least, so batch prompts keep moving), Sarathi-Serve's
    stall-free batching with a bound from the chats' deadlines (`step_bound`):
    a chat's TPOT is its average over all its tokens, so a chat with slack
    left (early in its output, or after fast steps) lets a longer step by, and
    one without holds steps to what keeps its average under the SLO; chats
    before their first token and the next chat to arrive bound it by their
    TTFT. With no chat live, or when the step's decodes alone should take
    longer than `tpot_ms` (no cap could meet it; shrinking would only slow the
    batch), batch chunks take the whole budget again.

    Bound: a request with deadline D is never overtaken by one that arrives
    after D (whose deadline is later, as every SLO is positive). A batch
    request is never starved: its deadline is fixed, so once new chats have
    later deadlines than its own, it goes first and no longer yields its seat.
    """

    name = "edf"
    preemptive = True
    TPOT_MARGIN = 0.8  # of a step's time bound that it is planned to take: room for noise
    ARRIVAL_SHARE = 0.4  # of the TTFT SLO that a step may take while chats are live

    def __init__(
        self,
        interactive_ttft_ms: float = 1000.0,
        batch_ttft_ms: float = 60000.0,
        tpot_ms: float = 0.0,
    ) -> None:
        if not (interactive_ttft_ms > 0 and batch_ttft_ms > 0):
            raise ValueError("default SLOs must be positive")
        if not tpot_ms >= 0:
            raise ValueError("the TPOT SLO must be positive (or 0: none)")
        self.interactive_ttft_ms = interactive_ttft_ms
        self.batch_ttft_ms = batch_ttft_ms
        self.tpot_s = tpot_ms / 1000.0
        self._view: StepView | None = None
        self._seat_wait: float | None = None  # this step's, computed at first need

    def deadline(self, req: Request) -> float:
        slo = req.slo_ttft_ms
        if slo is None or slo <= 0:
            slo = self.batch_ttft_ms if req.slo_class == "batch" else self.interactive_ttft_ms
        return req.arrival_time + slo / 1000.0

    def key(self, req: Request) -> tuple[float, int]:
        return (self.deadline(req), req.seq_id)

    def begin_step(self, view: StepView) -> None:
        self._view = view
        self._seat_wait = None

    def may_preempt(self, req: Request, victim: Request) -> bool:
        return (
            victim.slo_class == "batch"
            and req.slo_class != "batch"
            and self.key(victim) > self.key(req)
        )

    def must_displace(self, req: Request) -> bool:
        return self.slack(req) < 0.0

    def pick_displaced(self, candidates: Iterable[Request]) -> Request:
        return min(candidates, key=lambda r: (r.num_computed_tokens, -r.seq_id))

    def slack(self, req: Request) -> float:
        """Seconds waiting `req` can still wait for room and meet its deadline (-inf before
        the cost model is ready: act at once)."""
        view = self._view
        if view is None or not view.step_cost.ready:
            return -math.inf
        cost, stats = view.step_cost, view.stats
        budget = view.max_num_batched_tokens
        step_s = cost.predict(budget)
        # Its prefill in chunks of at most the budget, and the step already in flight.
        own = (-(-(req.length - req.num_computed_tokens) // budget) + 1) * step_s
        if self._seat_wait is None:
            decode_s = cost.predict(
                stats.last_num_batched_tokens, stats.last_decode_kv, stats.last_num_decodes
            )
            left = min(
                (r.token_limit - r.length - r.num_inflight for r in view.running
                 if r.status is RequestStatus.RUNNING),
                default=0,
            )  # fmt: skip
            self._seat_wait = max(0, left) * decode_s
        return self.deadline(req) - view.clock() - own - self._seat_wait

    def batch_chunk_cap(self, decode_tokens: int, decode_kv: int) -> int | None:
        view = self._view
        if self.tpot_s <= 0.0 or view is None or not view.num_interactive:
            return None
        cost = view.step_cost
        if not cost.ready:
            return None
        decode_s = cost.predict(decode_tokens, decode_kv, decode_tokens)
        if decode_s > self.tpot_s:
            return None  # the decodes alone miss the SLO: shrinking batch chunks cannot help
        bound = self.step_bound(decode_s) * self.TPOT_MARGIN
        return cost.tokens_within(bound, decode_kv, decode_tokens)

    def step_bound(self, decode_s: float) -> float:
        """The longest this step may take with every live chat still meeting its SLOs, if
        the steps after it take `decode_s`: the least of
        - a decoding chat's TPOT budget, its output tokens at most (N) times the SLO, less
          the time it has decoded and the N - done - 1 steps it still needs;
        - a chat still before its first token: the time to its TTFT deadline;
        - the earliest waiting chat's time to its deadline; and
        - `ARRIVAL_SHARE` of the TTFT SLO, for the chat that arrives while it runs."""
        view = self._view
        now = view.clock()
        tpot = self.tpot_s
        bound = self.ARRIVAL_SHARE * self.interactive_ttft_ms / 1000.0
        for r in view.running:
            if r.slo_class == "batch" or r.status is not RequestStatus.RUNNING:
                continue
            if r.first_token_time is None:
                allowed = self.deadline(r) - now
            else:
                total = r.token_limit - r.prompt_len
                left = total - len(r.output_ids) - r.num_inflight
                allowed = (
                    (total - 1) * tpot - (now - r.first_token_time) - max(0, left - 1) * decode_s
                )
            if allowed < bound:
                bound = allowed
        for r in view.waiting:  # in deadline order: the first chat is the most urgent
            if r.slo_class != "batch":
                bound = min(bound, self.deadline(r) - now)
                break
        return bound


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

    def begin_step(self, view: StepView) -> None:
        waiting, num_running, max_num_seqs = view.waiting, view.num_running, view.max_num_seqs
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
    sc = config.scheduler
    if sc.policy == "static":
        return {"window_s": sc.static_batch_window_ms / 1000.0}
    if sc.policy == "edf":
        return {"interactive_ttft_ms": sc.slo_ttft_ms, "tpot_ms": sc.slo_tpot_ms}
    return {}


def make_policy(name: str, **options: Any) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**options)
