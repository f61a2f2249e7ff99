"""Settling one step's result: append the sampled tokens, build the deltas, and report
the requests that are done (the scheduler finishes them).

Results come in plan order. A token sampled for a request that finished or was
aborted after the plan was made is dropped here (the planner assumed it would
continue). An abort's delta waits in the scheduler's `deferred` until the result
of the last plan that could still read the request's prompt has been settled.
"""

from __future__ import annotations

from collections.abc import Callable

from subway.ipc.messages import RequestDelta, StepResult
from subway.scheduler.block_manager import BlockManager
from subway.scheduler.request import Request, RequestStatus
from subway.scheduler.stats import SchedulerStats

_RUNNING = RequestStatus.RUNNING


def settle(
    result: StepResult,
    tokens: list[int],
    requests: dict[int, Request],
    block_manager: BlockManager,
    stats: SchedulerStats,
    clock: Callable[[], float],
    deltas: list[RequestDelta],
) -> list[tuple[Request, RequestDelta]]:
    """Settle one step's result: append its sampled `tokens` (one per `result.seq_ids`, or
    `result.num_tokens` each after a draft) to the live `requests`, and a delta for each
    to `deltas`. Returns the requests that reached a stop or their length, with their last
    delta: the scheduler finishes them (in this order)."""
    stats.last_worker_idle_time = result.idle_time
    stats.num_steps_total += 1
    stats.worker_busy_total += result.forward_time
    stats.worker_idle_total += result.idle_time
    get = requests.get
    append = deltas.append
    done: list[tuple[Request, RequestDelta]] = []
    extras = (
        result.logprobs is not None
        or result.prompt_logprobs is not None
        or result.embeddings is not None
    )
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
            _settle_draft(block_manager, stats, req, c - 1)
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
            req.first_token_time = clock()
            delta = _first_delta(req, run, reason)
        else:
            delta = RequestDelta(req.request_id, run, reason)
        if extras:
            _attach_logprobs(delta, result, i, lo, lo + used, first)
        append(delta)
        lo = hi
        if reason is not None:
            done.append((req, delta))
    return done


def fail(
    seq_ids: list[int], requests: dict[int, Request], deltas: list[RequestDelta]
) -> list[Request]:
    """The worker could not run a step for `seq_ids`: an "error" delta for each live one,
    returned for the scheduler to finish (the worker has forgotten them; the next plan
    lists them as finished)."""
    failed = []
    for sid in seq_ids:
        req = requests.get(sid)
        if req is None:
            continue
        req.num_inflight = 0
        req.num_computed_tokens = 0  # the failed step's KV is suspect: cache none of it
        delta = RequestDelta(req.request_id, [], "error")
        if not req.reported:
            req.reported = True
            delta.num_prompt_tokens = len(req.prompt_ids)
        deltas.append(delta)
        failed.append(req)
    return failed


def _settle_draft(
    block_manager: BlockManager, stats: SchedulerStats, req: Request, accepted: int
) -> None:
    """A step with a draft came back with `accepted` of its tokens: the rest of its slots
    go back (unless it was preempted meanwhile), and the counters count it."""
    if req.status is _RUNNING:
        req.num_computed_tokens -= req.num_draft - accepted
        block_manager.trim(req.seq_id, req.num_computed_tokens)
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
    if first and result.embeddings is not None:
        delta.embedding = result.embeddings[i]
