"""The scheduler: requests in, plans out, results in, token deltas out.

Pure Python with no sockets and no torch. `Scheduler` is the one owner of the queues
(waiting, running), the request tables, the ids the workers are told next
plan, the deltas not tied to a step and the KV block manager, with the rules
that change them (queueing, admitting, finishing, preempting). Making a plan
is `planner.py`, settling a step's result `settle.py`: each returns its
outcome (`Planned`, the requests done) and the scheduler applies it. The
figures are `stats.py`. The step loop that drives all of this, with the executor that runs
the plans, is `engine_core.py`.
"""

from __future__ import annotations

import bisect
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable

import msgspec

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AddRequest,
    EngineStats,
    GrammarReady,
    NewSeq,
    Plan,
    RequestDelta,
    StepResult,
)
from subway.scheduler.block_manager import TOKEN_TYPE, BlockManager
from subway.scheduler.grammars import GrammarTable
from subway.scheduler.lora import LoraTable
from subway.scheduler.planner import Planner
from subway.scheduler.policy import Policy, make_policy, policy_options
from subway.scheduler.request import Request, RequestStatus
from subway.scheduler.settle import fail, settle
from subway.scheduler.slo import StepCost
from subway.scheduler.speculative import SpeculativeConfig
from subway.scheduler.stats import SchedulerStats

log = logging.getLogger("subway.scheduler")

ARRIVAL_WINDOW_S = 2.0  # `arrival_rate` counts the requests queued over this long
MAX_ARRIVALS_KEPT = 4096  # and keeps at most this many stamps (the rate tops out there)

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED
_COMPILING = RequestStatus.COMPILING


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: list[int],
        clock: Callable[[], float] = time.time,
        policy: Policy | None = None,
        grammars_by_key: bool = False,
        kv_windows: tuple[int, ...] = (0,),  # the workers' KV groups (ipc/kv_groups.py)
    ) -> None:
        """`clock` stamps first tokens (and feeds time-dependent policies); it must be on
        the same scale as requests' `arrival_time` (the frontend's time.time()).
        `grammars_by_key`: send each grammar to the workers once and hold its requests until
        rank 0 has compiled it (`grammars.py`, the worker processes); else each NewSeq
        carries its grammar whole (a runner in this process compiles it at first sample)."""
        self.config = config
        self.caching = bool(config.cache.enable_prefix_caching)
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, self.caching, windows=kv_windows,
            track_digests=self.caching and config.parallel.data_parallel_size > 1,
        )  # fmt: skip
        pool = self.block_manager.capacity_tokens(config.scheduler.max_num_batched_tokens)
        # A request must fit in the pool alone, or it could never finish.
        self.max_model_len = min(max_model_len, pool) if max_model_len > 0 else pool
        self._eos = frozenset(eos_token_ids)
        if policy is None:
            policy = make_policy(config.scheduler.policy, **policy_options(config))
        self.policy = policy
        self.clock = clock
        self.stats = SchedulerStats()
        self.step_cost = StepCost()  # fed by the engine core as steps settle
        self.speculative = SpeculativeConfig.parse(config.scheduler.speculative_config)

        self.waiting: list[Request] = []  # sorted by policy.key
        self._unplanned = 0  # requests added since the last `schedule` (see `num_queued`)
        self.running: list[Request] = []  # may hold non-running entries until compacted
        self._running_dirty = False
        self._num_running = 0
        self.num_interactive = 0  # live requests not of the batch class (for `EDF`)
        self.by_seq: dict[int, Request] = {}  # live requests (waiting or running) by seq_id
        self._by_id: dict[str, Request] = {}  # the same, by request id
        self._next_seq_id = 0
        self.inflight_steps: deque[int] = deque()  # steps planned, result not yet settled
        self.finished_ids: list[int] = []  # known to workers, finished since the last plan
        self.preempted_ids: list[int] = []  # preempted, not yet told to workers
        self.pending: list[RequestDelta] = []  # deltas not tied to a step result
        self.deferred: list[tuple[int, RequestDelta]] = []  # (after result of step, delta)
        self._arrivals: deque[float] = deque(maxlen=MAX_ARRIVALS_KEPT)  # clock() of each add
        self.planner = Planner(self, config.scheduler, config.ipc.max_message_bytes)
        self.leases = None  # a prefill engine's `handoff.Leases`
        self.grammars = GrammarTable(config.server.grammar_timeout) if grammars_by_key else None
        self.loras = LoraTable(config.lora)
        self._wire = msgspec.msgpack.Encoder()  # sizes NewSeqs (`Request.wire_bytes`)

    # ------------------------------------------------------------ counts

    @property
    def max_num_seqs(self) -> int:
        return self.planner.max_num_seqs

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued(self) -> int:
        """Waiting requests that a plan has passed over: the queue admission counts.

        One added since the last `schedule` has not been weighed yet (a plan in flight
        holds the next one back) and may only be waiting for that plan. An abort of such a
        request can leave this one short until the next plan, never over.
        """
        return max(0, len(self.waiting) - self._unplanned)

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_inflight_plans(self) -> int:
        return len(self.inflight_steps)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_preempted_total(self) -> int:
        return self.stats.num_preempted_total

    @property
    def has_work(self) -> bool:
        """Something waits (for a grammar too), runs, or has a plan in flight."""
        if self.waiting or self._num_running or self.inflight_steps:
            return True
        return self.grammars is not None and self.grammars.holding()

    @property
    def has_pending_deltas(self) -> bool:
        return bool(self.pending)

    def request_ids(self) -> list[str]:
        """Every live request: waiting, running or with a token in flight."""
        return list(self._by_id)

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def arrival_rate(self) -> float:
        """Requests queued per second over the last `ARRIVAL_WINDOW_S` (by this clock)."""
        arrivals, since = self._arrivals, self.clock() - ARRIVAL_WINDOW_S
        while arrivals and arrivals[0] < since:
            arrivals.popleft()
        return len(arrivals) / ARRIVAL_WINDOW_S

    def engine_stats(self) -> EngineStats:
        s = self.stats.snapshot(
            self._num_running, len(self.waiting), self.num_queued, self.block_manager
        )
        self.loras.report(s)
        return s

    # ------------------------------------------------------------ requests

    def add(self, msg: AddRequest, prompt_ids: list[int]) -> None:
        """Queue a request. One that cannot be served finishes at once (a pending delta)."""
        n = len(prompt_ids)
        sp = msg.sampling
        reason = None
        ids = None
        taken = msg.request_id in self._by_id or not self.loras.accepts(msg.lora)  # LoRA served?
        if taken or n == 0 or n > self.max_model_len:
            reason = "error"
        else:
            try:
                ids = array(TOKEN_TYPE, prompt_ids)
            except (OverflowError, TypeError):  # not token ids
                reason = "error"
        token_limit = min(self.max_model_len, n + max(sp.max_tokens, 0))
        if reason is None and n >= token_limit:  # no room for a single token
            reason = "length"
        if reason is not None:
            self.pending.append(RequestDelta(msg.request_id, [], reason, num_prompt_tokens=n))
            return
        self._arrivals.append(self.clock())  # one a step could take (`arrival_rate`)
        if sp.ignore_eos:
            stop_ids = frozenset(sp.stop_token_ids)
        elif sp.stop_token_ids:
            stop_ids = self._eos.union(sp.stop_token_ids)
        else:
            stop_ids = self._eos
        req = Request(
            seq_id=self._next_seq_id,
            request_id=msg.request_id,
            prompt_ids=ids,
            prompt_ref=msg.prompt,
            sampling=sp,
            arrival_time=msg.arrival_time,
            stop_ids=stop_ids,
            token_limit=token_limit,
            priority=msg.priority,
            slo_ttft_ms=msg.slo_ttft_ms,
            slo_class=msg.slo_class,
            length=n,
            speculable=self.speculative is not None and sp.grammar is None,
            handoff=msg.handoff,
            lora=msg.lora,
        )
        grammar = None
        if self.grammars is not None and sp.grammar is not None:
            req.sampling, grammar, req.grammar_key = GrammarTable.by_key(sp)
        new_seq = NewSeq(req.seq_id, req.prompt_ref, req.sampling, req.lora)
        req.wire_bytes = len(self._wire.encode(new_seq))
        if req.wire_bytes > self.planner.max_new_seq_bytes:  # no plan could carry it
            self.pending.append(RequestDelta(msg.request_id, [], "error", num_prompt_tokens=n))
            return
        self._next_seq_id += 1
        if req.slo_class != "batch":
            self.num_interactive += 1
        self.by_seq[req.seq_id] = req
        self._by_id[msg.request_id] = req
        self.loras.joined(req.lora)
        held = grammar is not None and self.grammars.hold(req, grammar, self.clock())
        if held:
            req.status = _COMPILING
            return
        self.enqueue(req)
        self._unplanned += 1

    def on_grammar(self, msg: GrammarReady) -> None:
        """Rank 0 compiled a grammar (its requests join the queue) or could not (they end
        with an error)."""
        assert self.grammars is not None
        ready, failed, why = self.grammars.answer(msg)
        self._release_held(ready, failed, why)

    def expire_grammars(self) -> None:
        """End the requests whose grammar's compile rank 0 has not answered in time."""
        if self.grammars is not None and self.grammars.entries:
            late = self.grammars.overdue(self.clock())
            self._release_held([], late, "the grammar's compile took too long")

    def _release_held(self, ready: list[Request], failed: list[Request], why: str) -> None:
        for req in ready:
            if req.status is _COMPILING:
                req.status = _WAITING
                self.enqueue(req)
                self._unplanned += 1
        for req in failed:
            if req.status is _COMPILING:
                self.pending.append(
                    RequestDelta(
                        req.request_id, [], "error", num_prompt_tokens=req.prompt_len, error=why
                    )
                )
                self.finish(req)
        if failed:
            log.warning("%d request(s) end with an error: %s", len(failed), why[:500])

    def abort(self, request_id: str) -> None:
        """Drop a request. Its "abort" delta goes out once no sent plan can still read its prompt."""
        req = self._by_id.get(request_id)
        if req is None:
            return
        if req.reported:
            delta = RequestDelta(request_id, [], "abort")
        else:
            delta = RequestDelta(
                request_id,
                [],
                "abort",
                num_prompt_tokens=req.prompt_len,
                num_cached_tokens=req.num_cached_tokens,
            )
        if req.sent and self.inflight_steps:
            self.deferred.append((self.inflight_steps[-1], delta))
        else:
            self.pending.append(delta)
        self.finish(req)

    def pop_pending_deltas(self) -> list[RequestDelta]:
        """Deltas that no step result carries (errors at add, aborts); `process_result` also
        returns them."""
        out, self.pending = self.pending, []
        return out

    # ------------------------------------------------------------ a step

    def schedule(self) -> Plan | None:
        """The next step's plan (see `planner.py`), or None if nothing can be scheduled now."""
        t0 = time.perf_counter()
        self._unplanned = 0
        stats = self.stats
        step = stats.num_steps_planned
        self.compact_running()
        waiting, policy = self.waiting, self.policy
        if policy.dynamic and len(waiting) > 1:
            policy.refresh(self.clock())
            waiting.sort(key=policy.key)
        out = self.planner.plan(step)
        if out.num_admitted:
            if out.scattered:
                self.waiting = [r for r in waiting if r.status is _WAITING]
            else:
                del waiting[: out.num_admitted]
        for req in out.requeue:
            self.enqueue(req)
        stats.chunk_capped_steps_total += out.capped
        stats.pooling_limited_steps_total += out.pool_limited
        if not out.steps:
            return None
        plan = Plan(step, out.steps, out.new_seqs, self.finished_ids, self.preempted_ids)
        self.loras.announce(plan)
        self.finished_ids, self.preempted_ids = [], []
        self.inflight_steps.append(step)
        stats.num_steps_planned = step + 1
        stats.last_batch_size = len(out.steps)
        stats.last_num_batched_tokens = out.num_batched_tokens
        stats.last_decode_kv = out.decode_kv
        stats.last_num_decodes = out.decode_tokens
        stats.last_schedule_time = time.perf_counter() - t0
        stats.schedule_time_total += stats.last_schedule_time
        return plan

    def process_result(self, result: StepResult, tokens: list[int]) -> list[RequestDelta]:
        """Settle the oldest plan in flight (see `settle.py`) and finish the requests it
        ended; the deltas for the frontend, the pending ones first."""
        inflight = self.inflight_steps
        if not inflight or inflight[0] != result.step:
            expected = inflight[0] if inflight else None
            raise ValueError(f"result of step {result.step}, expected {expected}")
        inflight.popleft()
        deltas = self.pop_pending_deltas()
        if result.failed:
            for req in fail(result.failed, self.by_seq, deltas):
                self.finish(req)
            self.stats.num_failed_total += len(result.failed)
        done = settle(
            result, tokens, self.by_seq, self.block_manager, self.stats, self.clock, deltas
        )
        for req, delta in done:
            if delta.finish_reason == "length" and req.handoff and self.leases is not None:
                delta.kv_lease = self.leases.grant(req)  # its blocks outlive it
            self.finish(req)
        if self.deferred:
            step = result.step
            deltas.extend(d for after, d in self.deferred if after <= step)
            self.deferred = [item for item in self.deferred if item[0] > step]
        return deltas

    def push_delta(self, delta: RequestDelta) -> None:
        """A delta no step result carries (an abort before queueing, say): sent with the
        next ones."""
        self.pending.append(delta)

    # ------------------------------------------------------------ rules both sides share

    def enqueue(self, req: Request) -> None:
        bisect.insort_right(self.waiting, req, key=self.policy.key)

    def compact_running(self) -> list[Request]:
        """The running list without the requests that left it since the last call."""
        if self._running_dirty:
            self.running = [r for r in self.running if r.status is _RUNNING]
            self._running_dirty = False
        return self.running

    def mark_running(self, req: Request) -> None:
        """An admitted request (its blocks allocated) joins the running list."""
        req.status = _RUNNING
        self.running.append(req)
        self._num_running += 1
        self.loras.started(req.lora)
        if req.preempted:
            req.preempted = False
            self.stats.num_preempted_waiting -= 1

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and mark it waiting (the planner requeues it)."""
        if self.caching:
            self.cache_blocks(req, req.num_computed_tokens)  # for its own return, and others
        self.block_manager.free(req.seq_id)
        req.status = _WAITING
        req.num_computed_tokens = 0
        req.num_slots = 0
        req.preempted = True
        self._num_running -= 1
        self.loras.stopped(req.lora)
        self._running_dirty = True
        stats = self.stats
        stats.num_preempted_waiting += 1
        stats.num_preempted_total += 1
        self.preempted_ids.append(req.seq_id)  # running implies sent

    def finish(self, req: Request) -> None:
        """Take a request out of the scheduler: free its blocks, tell the workers next plan."""
        self.loras.left(req.lora)
        if req.status is _RUNNING:
            self._num_running -= 1
            self._running_dirty = True
            self.loras.stopped(req.lora)
            if self.caching:
                self.cache_blocks(req, req.num_computed_tokens)  # for later turns of a chat
            self.block_manager.free(req.seq_id)
            req.num_slots = 0
        elif req.status is _COMPILING:
            self.grammars.unhold(req)  # type: ignore[union-attr]
        elif req.status is _WAITING:
            self.waiting.remove(req)
            if req.seq_id in self.preempted_ids:
                self.preempted_ids.remove(req.seq_id)
            if req.preempted:
                req.preempted = False
                self.stats.num_preempted_waiting -= 1
        req.status = _FINISHED
        if req.slo_class != "batch":
            self.num_interactive -= 1
        del self.by_seq[req.seq_id]
        del self._by_id[req.request_id]
        if req.grammar_key:
            self.grammars.drop(req)  # type: ignore[union-attr]
        if req.sent:
            self.finished_ids.append(req.seq_id)

    def cache_blocks(self, req: Request, upto: int) -> None:
        """Key the request's full blocks below `upto` (computed by sent plans) whose tokens
        are known."""
        if upto > req.length:
            upto = req.length
        req.cache_upto = self.block_manager.cache_blocks(
            req.seq_id, req.prompt_ids, req.output_ids, upto, -req.lora
        )
