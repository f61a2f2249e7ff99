"""Settling one step's result: append the sampled tokens, finish requests, build the deltas.

Results come in plan order. A token sampled for a request that finished or was
aborted after the plan was made is dropped here (the planner assumed it would
continue). An abort's delta waits in `deferred` until the result of the last
plan that could still read the request's prompt has been settled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from subway.ipc.messages import RequestDelta, StepResult
from subway.scheduler.request import Request

if TYPE_CHECKING:
    from subway.scheduler.scheduler import Scheduler


def settle(sched: Scheduler, result: StepResult, tokens: list[int]) -> list[RequestDelta]:
    """Settle the oldest plan in flight: append its sampled `tokens` (one per
    `result.seq_ids`), finish requests, free their blocks; the deltas for the frontend
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
    i = -1
    for sid, tok in zip(result.seq_ids, tokens, strict=True):
        i += 1
        req = get(sid)
        if req is None:
            continue  # finished or aborted after the plan was made
        req.num_inflight -= 1
        req.output_ids.append(tok)
        n = req.length = req.length + 1
        if tok in req.stop_ids:
            reason = "stop"
        elif n >= req.token_limit:
            reason = "length"
        else:
            reason = None
        first = not req.reported
        if first:
            delta = _first_delta(req, tok, reason)
        else:
            delta = RequestDelta(req.request_id, [tok], reason)
        if extras:
            _attach_logprobs(delta, result, i, first)
        append(delta)
        if reason is not None:
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


def _first_delta(req: Request, tok: int, reason: str | None) -> RequestDelta:
    """A request's first delta: with its prompt length, cached tokens and queue time."""
    req.reported = True
    delta = RequestDelta(
        req.request_id,
        [tok],
        reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_cached_tokens=req.num_cached_tokens,
    )
    if req.first_scheduled_time is not None:
        delta.queue_time = max(0.0, req.first_scheduled_time - req.arrival_time)
    return delta


def _attach_logprobs(delta: RequestDelta, result: StepResult, i: int, first: bool) -> None:
    """The `i`-th sampled token's logprobs (and, on a first delta, the prompt's) from a result."""
    if result.logprobs is not None:
        delta.logprobs = [result.logprobs[i]]
        if result.top_ids is not None:
            delta.top_ids = [result.top_ids[i]]
        if result.top_logprobs is not None:
            delta.top_logprobs = [result.top_logprobs[i]]
    if first and result.prompt_logprobs is not None:
        delta.prompt_logprobs = result.prompt_logprobs[i]
