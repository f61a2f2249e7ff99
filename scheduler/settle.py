"""Settling one step's result: append the sampled tokens, finish requests, build the deltas.

Results come in plan order. A token sampled for a request that finished or was
aborted after the plan was made is dropped here (the planner assumed it would
continue). An abort's delta waits in `deferred` until the result of the last
plan that could still read the request's prompt has been settled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from subway.ipc.messages import RequestDelta, StepResult
from subway.scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING

if TYPE_CHECKING:
    from subway.scheduler.scheduler import Scheduler


def settle(sched: Scheduler, result: StepResult, tokens: list[int]) -> list[RequestDelta]:
    """Settle the oldest plan in flight: append its sampled `tokens` (one per
    `result.seq_ids`, or `result.num_tokens` each after a draft), finish requests, free their blocks; the deltas for the frontend
    (the scheduler's pending ones first)."""
    inflight = sched.inflight_steps
    if not inflight or inflight[0] != result.step:
        expected = inflight[0] if inflight else None
        raise ValueError(f"result of step {result.step}, expected {expected}")
    inflight.popleft()
    stats = sched.stats
    stats.last_worker_idle_time = result.idle_time
    stats.num_steps_total += 1
    stats.worker_busy_total += result.forward_time
    stats.worker_idle_total += result.idle_time
    deltas = sched.pop_pending_deltas()
    get = sched.by_seq.get
    if result.failed:
        _fail(sched, result, deltas)
    append = deltas.append
    extras = result.logprobs is not None or result.prompt_logprobs is not None
    counts = result.num_tokens
    lo = 0  # this sequence's first token in `tokens`
    for i, sid in enumerate(result.seq_ids):
        c = counts[i] if counts else 1
        hi = lo + c
        req = get(sid)
        if req is None:
            lo = hi
            continue  # finished or aborted after the plan was made
        req.num_inflight -= 1
        if req.num_draft:
            _settle_draft(sched, req, c - 1)
        out = req.output_ids
        n = req.length
        limit = req.token_limit
        stop_ids = req.stop_ids
        reason = None
        used = 0
        for tok in tokens[lo:hi]:
            out.append(tok)
            n += 1
            used += 1
            if tok in stop_ids:
                reason = "stop"
            elif n >= limit:
                reason = "length"
            else:
                continue
            break
        req.length = n
        run = tokens[lo : lo + used] if c > 1 else [tokens[lo]]
        first = not req.reported
        if first:
            req.first_token_time = sched.clock()
            delta = _first_delta(req, run, reason)
        else:
            delta = RequestDelta(req.request_id, run, reason)
        if extras:
            _attach_logprobs(delta, result, i, lo, lo + used, first)
        append(delta)
        lo = hi
        if reason is not None:
            if reason == "length" and req.handoff and sched.leases is not None:
                delta.kv_lease = sched.leases.grant(req)  # its blocks outlive it
            sched.finish(req)
    if sched.deferred:
        step = result.step
        deltas.extend(d for after, d in sched.deferred if after <= step)
        sched.deferred = [item for item in sched.deferred if item[0] > step]
    return deltas


def _fail(sched: Scheduler, result: StepResult, deltas: list[RequestDelta]) -> None:
    """The worker could not run this step for `result.failed`: end their requests with
    "error" (the worker has forgotten them; the next plan lists them as finished)."""
    for sid in result.failed:
        req = sched.by_seq.get(sid)
        if req is None:
            continue
        req.num_inflight = 0
        req.num_computed_tokens = 0  # the failed step's KV is suspect: cache none of it
        delta = RequestDelta(req.request_id, [], "error")
        if not req.reported:
            req.reported = True
            delta.num_prompt_tokens = len(req.prompt_ids)
        deltas.append(delta)
        sched.finish(req)
    sched.stats.num_failed_total += len(result.failed)


def _settle_draft(sched: Scheduler, req: Request, accepted: int) -> None:
    """A step with a draft came back with `accepted` of its tokens: the rest of its slots
    go back (unless it was preempted meanwhile), and the counters count it."""
    if req.status is _RUNNING:
        req.num_computed_tokens -= req.num_draft - accepted
        sched.block_manager.trim(req.seq_id, req.num_computed_tokens)
    stats = sched.stats
    stats.spec_drafts_total += 1
    stats.spec_draft_tokens_total += req.num_draft
    stats.spec_accepted_tokens_total += accepted
    req.num_draft = 0


def _first_delta(req: Request, run: list[int], reason: str | None) -> RequestDelta:
    """A request's first delta: with its prompt length, cached tokens and queue time."""
    req.reported = True
    delta = RequestDelta(
        req.request_id,
        run,
        reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_cached_tokens=req.num_cached_tokens,
    )
    if req.first_scheduled_time is not None:
        delta.queue_time = max(0.0, req.first_scheduled_time - req.arrival_time)
    return delta


def _attach_logprobs(
    delta: RequestDelta, result: StepResult, i: int, lo: int, hi: int, first: bool
) -> None:
    """Tokens `lo:hi`'s logprobs, those of the `i`-th sampled sequence (and, on a first
    delta, its prompt's) from a result."""
    if result.logprobs is not None:
        delta.logprobs = result.logprobs[lo:hi]
        if result.top_ids is not None:
            delta.top_ids = result.top_ids[lo:hi]
        if result.top_logprobs is not None:
            delta.top_logprobs = result.top_logprobs[lo:hi]
    if first and result.prompt_logprobs is not None:
        delta.prompt_logprobs = result.prompt_logprobs[i]
