"""The scheduler's logic: queues, token budget, KV blocks, prefix cache, preemption;
one `Plan` per step.

Pure Python with no sockets: the process loop (`process.py`) and the offline
engine feed it requests and step results and send the plans it makes.

A step. Every running sequence that decodes gets its one token first (while
the budget lasts; `max_num_seqs` never exceeds the budget, so all do). Then
the rest of the `max_num_batched_tokens` budget goes, in the policy's order,
to the next prefill chunks of running sequences and to admissions from the
waiting queue: each sequence gets at most one chunk per step, the last one
may be partial. Admission stops at the first waiting sequence that does not
fit (no overtaking), unless the policy lets it preempt running work.

Overlap: `schedule()` may run again before the result of the previous plan
arrives. A sequence whose sampled token is still in flight is assumed to
continue, so its next decode starts one position further; results then come
in plan order and settle what really happened. A sequence found finished at
result N was also planned in N+1 (already sent): that token is discarded, and
its blocks, freed at once, go to plan N+2 at the earliest. That is safe because
workers run plans in order. Blocks of a sequence preempted while plan N+1 is
built may even go to N+1 itself: plan N, which still writes to them, runs first.

Preemption is by recompute. The policy picks the victim among the running
sequences not admitted in this step; one already placed in this plan is taken
out of it again. A preempted sequence keeps any token already in flight: it
was computed with intact KV, and the workers append every token they sample
to their copy of the sequence, so both sides stay in agreement. It is
admitted again only when nothing of it is in flight, re-prefilled over
prompt + output (from its cached prefix, if the prefix cache still has it).

Prefix caching (`enable_prefix_caching`). A full block is keyed in the cache
(see `block_manager.py`) only once a sent plan has computed all of it, never
in the plan that computes it, so a hit always reads KV that an earlier plan
wrote: the blocks a prefill fills are keyed when the sequence is next
scheduled (its next chunk or its first decode), so that requests arriving
meanwhile share them; the blocks it fills while decoding are keyed when it
finishes or is preempted (for the next turn of a chat, or its own return),
which costs nothing per decode step. An admission looks up the longest cached
prefix of its tokens, at most `(num_tokens - 1) // block_size` blocks so that
the last token is computed, and its first `SeqStep` starts there: `start_pos`
= cached tokens, `new_blocks` = its whole table, cached blocks first. Shared
blocks are full and never written again, so there is no copy-on-write.
"""

from __future__ import annotations

import bisect
import time
from array import array
from collections import deque
from collections.abc import Callable

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AddRequest,
    EngineStats,
    NewSeq,
    Plan,
    RequestDelta,
    SeqStep,
    StepResult,
)
from subway.scheduler.block_manager import TOKEN_TYPE, BlockManager
from subway.scheduler.policy import Policy, make_policy, policy_options
from subway.scheduler.request import NEVER, SeqStatus, Sequence

_WAITING = SeqStatus.WAITING
_RUNNING = SeqStatus.RUNNING
_FINISHED = SeqStatus.FINISHED

# _admit outcomes
_ADMITTED, _SKIPPED, _BLOCKED = 1, 0, -1


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: list[int],
        clock: Callable[[], float] = time.time,
        policy: Policy | None = None,
    ) -> None:
        """`clock` stamps first tokens (and feeds time-dependent policies); it must be on
        the same scale as requests' `arrival_time` (the frontend's time.time())."""
        self.config = config
        self.caching = bool(config.cache.enable_prefix_caching)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, self.caching)
        pool = self.block_manager.capacity_tokens
        # A sequence must fit in the pool alone, or it could never finish.
        self.max_model_len = min(max_model_len, pool) if max_model_len > 0 else pool
        self.eos_token_ids = list(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.policy = (
            policy if policy is not None else make_policy(config.scheduler.policy, **policy_options(config))
        )
        self.clock = clock
        self.max_num_batched_tokens = max(1, config.scheduler.max_num_batched_tokens)
        # Every running sequence gets its decode each step: no more running than the budget.
        self.max_num_seqs = max(1, min(config.scheduler.max_num_seqs, self.max_num_batched_tokens))
        # Keep a few blocks for running sequences to grow into when admitting more.
        self.watermark_blocks = num_blocks // 100

        self.waiting: list[Sequence] = []  # sorted by policy.key
        self.running: list[Sequence] = []  # may hold non-running entries while _running_dirty
        self._running_dirty = False
        self._num_running = 0
        self._seqs: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._next_step = 0
        self._inflight_steps: deque[int] = deque()  # steps planned, result not yet processed
        self._finished_ids: list[int] = []  # known to workers, finished since the last plan
        self._preempted_ids: list[int] = []  # preempted, not yet told to workers
        self._pending: list[RequestDelta] = []  # deltas not tied to a step result
        self._deferred: list[tuple[int, RequestDelta]] = []  # (after result of step, delta)
        # While a plan is built: its steps, sequences preempted in it (queued at the end),
        # and budget given back by sequences taken out of it.
        self._steps: list[SeqStep] = []
        self._requeue: list[Sequence] = []
        self._released = 0

        self.num_preempted_total = 0
        self.num_preempted_waiting = 0  # waiting after a preemption, now
        self.num_finished_total = 0
        self.prefix_queries_total = 0  # tokens of admitted sequences (prompt + output)
        self.prefix_hits_total = 0  # of which found in the prefix cache
        self.last_batch_size = 0
        self.last_num_batched_tokens = 0
        self.last_schedule_time = 0.0
        self.schedule_time_total = 0.0
        self.num_steps_total = 0
        self.worker_busy_total = 0.0
        self.worker_idle_total = 0.0
        self.last_worker_idle_time = 0.0
        self.last_step_time = 0.0  # set by whoever times the steps (the process loop)

    # ------------------------------------------------------------ counts

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_inflight_plans(self) -> int:
        return len(self._inflight_steps)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_steps(self) -> int:
        return self._next_step

    @property
    def has_work(self) -> bool:
        """Something waits, runs, or has a plan in flight."""
        return bool(self.waiting or self._num_running or self._inflight_steps)

    @property
    def has_pending_deltas(self) -> bool:
        return bool(self._pending)

    def request_ids(self) -> list[str]:
        """Every live request: waiting, running or with a token in flight."""
        return list(self._by_request)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_request.get(request_id)

    def sequences(self) -> list[Sequence]:
        """Every live sequence (waiting or running)."""
        return list(self._seqs.values())

    # ------------------------------------------------------------ requests

    def add(self, req: AddRequest, prompt_ids: list[int]) -> None:
        """Queue a request. One that cannot be served finishes at once (a pending delta)."""
        n = len(prompt_ids)
        sp = req.sampling
        if req.request_id in self._by_request:
            self._pending.append(RequestDelta(req.request_id, [], "error", num_prompt_tokens=n))
            return
        if n == 0 or n > self.max_model_len:
            self._pending.append(RequestDelta(req.request_id, [], "error", num_prompt_tokens=n))
            return
        try:
            ids = array(TOKEN_TYPE, prompt_ids)
        except (OverflowError, TypeError):  # not token ids
            self._pending.append(RequestDelta(req.request_id, [], "error", num_prompt_tokens=n))
            return
        token_limit = min(self.max_model_len, n + max(sp.max_tokens, 0))
        if n >= token_limit:  # no room for a single token
            self._pending.append(RequestDelta(req.request_id, [], "length", num_prompt_tokens=n))
            return
        if sp.ignore_eos:
            stop_ids = frozenset(sp.stop_token_ids)
        elif sp.stop_token_ids:
            stop_ids = self._eos.union(sp.stop_token_ids)
        else:
            stop_ids = self._eos
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=req.request_id,
            prompt_ids=ids,
            prompt_ref=req.prompt,
            sampling=sp,
            arrival_time=req.arrival_time,
            stop_ids=stop_ids,
            token_limit=token_limit,
            priority=req.priority,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_class=req.slo_class,
            num_tokens=n,
        )
        self._next_seq_id += 1
        self._seqs[seq.seq_id] = seq
        self._by_request[req.request_id] = seq
        self._enqueue(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request. Its "abort" delta goes out once no sent plan can still read its prompt."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return
        if seq.reported:
            delta = RequestDelta(request_id, [], "abort")
        else:
            delta = RequestDelta(
                request_id,
                [],
                "abort",
                num_prompt_tokens=seq.prompt_len,
                num_cached_tokens=seq.num_cached_tokens,
            )
        if seq.sent and self._inflight_steps:
            self._deferred.append((self._inflight_steps[-1], delta))
        else:
            self._pending.append(delta)
        self._finish(seq, "abort")

    def pop_pending_deltas(self) -> list[RequestDelta]:
        """Deltas that no step result carries (errors at add, aborts); `process_result` also
        returns them."""
        out, self._pending = self._pending, []
        return out

    # ------------------------------------------------------------ planning

    def schedule(self) -> Plan | None:
        """The next step's plan, or None if nothing can be scheduled now."""
        t0 = time.perf_counter()
        step = self._next_step
        if self._running_dirty:
            self.running = [s for s in self.running if s.status is _RUNNING]
            self._running_dirty = False
        policy = self.policy
        waiting = self.waiting
        if waiting:
            if policy.dynamic and len(waiting) > 1:
                policy.refresh(self.clock())
                waiting.sort(key=policy.key)
            policy.begin_step(waiting, self._num_running, self.max_num_seqs)
        bm = self.block_manager
        claimed = bm.claimed
        bs = bm.block_size
        budget = self.max_num_batched_tokens
        steps: list[SeqStep] = []
        self._steps = steps
        new_seqs: list[NewSeq] = []
        num_preempted_before = len(self._preempted_ids)
        prefills: list[Sequence] = []

        # 1. Decodes: one token each, from the token sampled last step (maybe still in flight).
        for seq in self.running:
            if seq.status is not _RUNNING:
                continue
            inflight = seq.num_inflight
            total = seq.num_tokens + inflight
            pos = seq.num_computed_tokens
            if total - pos != 1:
                if total - pos > 1:
                    prefills.append(seq)
                continue  # or its last token is already in flight
            if total >= seq.token_limit:
                continue  # its last token is already in flight
            sid = seq.seq_id
            if pos < seq.num_slots:  # its last block has room: no allocation
                claimed[sid] = pos + 1
                new_blocks = []
            else:
                try:
                    new_blocks = bm.allocate(sid, 1)
                except MemoryError:
                    if not self._make_room(seq, 1, step):
                        continue
                    budget += self._take_released()
                    new_blocks = bm.allocate(sid, 1)
                seq.num_slots += bs * len(new_blocks)
            if pos >= seq.cache_upto:  # its first decode: key what its prefill computed
                bm.cache_blocks(sid, seq.prompt_ids, seq.output_ids, pos)  # (tokens < pos known)
                seq.cache_upto = NEVER  # what it decodes is keyed when it finishes or is preempted
            steps.append(SeqStep(sid, pos, 1, new_blocks, True))
            seq.num_computed_tokens = pos + 1
            seq.num_inflight = inflight + 1
            seq.scheduled_step = step
            budget -= 1
            if budget == 0:
                break

        # 2. Prefill chunks of running sequences and admissions, in policy order.
        if budget > 0 and (prefills or waiting):
            budget = self._prefill_and_admit(
                step, budget, prefills, new_seqs, len(self._preempted_ids) == num_preempted_before
            )

        if self._requeue:
            for seq in self._requeue:
                self._enqueue(seq)
            self._requeue = []
        self._steps = []
        if not steps:
            return None
        plan = Plan(step, steps, new_seqs, self._finished_ids, self._preempted_ids)
        self._finished_ids = []
        self._preempted_ids = []
        self._next_step = step + 1
        self._inflight_steps.append(step)
        self.last_batch_size = len(steps)
        self.last_num_batched_tokens = self.max_num_batched_tokens - budget
        self.last_schedule_time = time.perf_counter() - t0
        self.schedule_time_total += self.last_schedule_time
        return plan

    def _prefill_and_admit(
        self,
        step: int,
        budget: int,
        prefills: list[Sequence],
        new_seqs: list[NewSeq],
        admitting: bool,
    ) -> int:
        """Give the budget to running prefills and waiting sequences, merged in policy order;
        returns the budget left. Admission stops at the first waiting sequence that cannot
        be admitted, and is off for the step once it had to preempt for blocks."""
        key = self.policy.key
        bm = self.block_manager
        steps = self._steps
        waiting = self.waiting
        if len(prefills) > 1:
            prefills.sort(key=key)
        nw, npf = len(waiting), len(prefills)
        wi = pi = 0
        admitted = 0
        passed = False  # a waiting sequence was passed over (it stays)
        scattered = False  # and one after it was admitted: the admitted are not a prefix
        admitting = admitting and nw > 0
        while budget > 0:
            if admitting and wi < nw and (pi == npf or key(waiting[wi]) < key(prefills[pi])):
                seq = waiting[wi]
                wi += 1
                outcome, budget = self._admit(seq, step, budget, new_seqs)
                if outcome == _ADMITTED:
                    admitted += 1
                    scattered = passed
                elif outcome == _SKIPPED:
                    passed = True
                else:
                    admitting = False
                continue
            if pi == npf:
                break
            seq = prefills[pi]
            pi += 1
            if seq.status is not _RUNNING:
                continue  # preempted in this step
            pos = seq.num_computed_tokens
            remaining = seq.num_tokens + seq.num_inflight - pos
            sid = seq.seq_id
            n = remaining if remaining < budget else budget
            fit = bm.max_new_tokens(sid)
            if fit < n:
                if fit <= 0:  # preempt for one block at least, then take what fits
                    admitting = False
                    if not self._make_room(seq, 1, step):
                        continue
                    budget += self._take_released()
                    n = remaining if remaining < budget else budget
                    fit = bm.max_new_tokens(sid)
                n = fit if fit < n else n  # a smaller chunk rather than more preemption
            if pos >= seq.cache_upto:
                self._cache_blocks(seq, pos)
            sample = n == remaining
            new_blocks = bm.allocate(sid, n)
            seq.num_slots += bm.block_size * len(new_blocks)
            steps.append(SeqStep(sid, pos, n, new_blocks, sample))
            seq.num_computed_tokens = pos + n
            if sample:
                seq.num_inflight += 1
            seq.scheduled_step = step
            budget -= n
        if admitted:
            if scattered:
                self.waiting = [s for s in waiting if s.status is _WAITING]
            else:
                del waiting[:admitted]
        return budget

    def _admit(
        self, seq: Sequence, step: int, budget: int, new_seqs: list[NewSeq]
    ) -> tuple[int, int]:
        """Admit one waiting sequence with its first chunk: (_ADMITTED, budget left), or
        _SKIPPED (not now, try the next one) or _BLOCKED (stop admitting)."""
        if seq.num_inflight:  # preempted with a token in flight: wait for it
            return _SKIPPED, budget
        if not self.policy.can_admit(seq):
            return _SKIPPED, budget
        while self._num_running >= self.max_num_seqs:
            if not self._displace(seq, step):
                return _BLOCKED, budget
            budget += self._take_released()
        bm = self.block_manager
        bs = bm.block_size
        total = seq.num_tokens
        # A request that wants its prompt's logprobs computes the whole prompt.
        if self.caching and seq.sampling.prompt_logprobs is None:
            hits = bm.lookup(seq.prompt_ids, seq.output_ids, (total - 1) // bs)
        else:
            hits = []
        cached = len(hits) * bs
        remaining = total - cached
        while True:
            n = remaining if remaining < budget else budget
            watermark = self.watermark_blocks if self._num_running else 0
            if bm.admission_cost(hits, n) + watermark <= bm.num_free_blocks:
                break
            if not self._displace(seq, step):  # no overtaking: the head waits for blocks
                return _BLOCKED, budget
            budget += self._take_released()
        sid = seq.seq_id
        table = bm.allocate_with_prefix(sid, hits, n)
        seq.num_slots = bs * len(table)
        seq.status = _RUNNING
        self.running.append(seq)
        self._num_running += 1
        if not seq.sent:
            new_seqs.append(NewSeq(sid, seq.prompt_ref, seq.sampling))
            seq.sent = True
        if seq.preempted:
            seq.preempted = False
            self.num_preempted_waiting -= 1
        sample = n == remaining
        self._steps.append(SeqStep(sid, cached, n, table, sample))
        seq.num_computed_tokens = cached + n
        if sample:
            seq.num_inflight = 1
        seq.scheduled_step = step
        seq.admitted_step = step
        if self.caching:
            seq.cache_upto = (len(hits) + 1) * bs
            self.prefix_queries_total += total
            self.prefix_hits_total += cached
        if not seq.reported:
            seq.num_cached_tokens = cached
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
        return _ADMITTED, budget - n

    def _cache_blocks(self, seq: Sequence, upto: int) -> None:
        """Key the sequence's full blocks below `upto` (computed by sent plans) whose tokens
        are known."""
        if upto > seq.num_tokens:
            upto = seq.num_tokens
        seq.cache_upto = self.block_manager.cache_blocks(
            seq.seq_id, seq.prompt_ids, seq.output_ids, upto
        )

    def _take_released(self) -> int:
        n, self._released = self._released, 0
        return n

    def _make_room(self, seq: Sequence, n: int, step: int) -> bool:
        """Preempt until `seq` can claim `n` more tokens; False if `seq` itself was preempted.

        Victims are running sequences not admitted in this step (`seq`
        included), chosen by the policy; budget they give back is in `_released`.
        """
        bm = self.block_manager
        while not bm.can_allocate(seq.seq_id, n):
            candidates = [
                s for s in self.running if s.status is _RUNNING and s.admitted_step != step
            ]
            victim = self.policy.pick_victim(candidates)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _displace(self, seq: Sequence, step: int) -> bool:
        """Preempt one running sequence that the policy lets waiting `seq` displace; False if
        there is none."""
        policy = self.policy
        if not policy.preemptive:
            return False
        may = policy.may_preempt
        candidates = [
            s
            for s in self.running
            if s.status is _RUNNING and s.admitted_step != step and may(seq, s)
        ]
        if not candidates:
            return False
        self._preempt(policy.pick_victim(candidates), step)
        return True

    def _preempt(self, seq: Sequence, step: int) -> None:
        if seq.scheduled_step == step:  # take it out of the plan being built
            steps = self._steps
            sid = seq.seq_id
            for i in range(len(steps) - 1, -1, -1):
                st = steps[i]
                if st.seq_id == sid:
                    del steps[i]
                    self._released += st.num_tokens
                    seq.num_computed_tokens = st.start_pos
                    if st.sample:
                        seq.num_inflight -= 1
                    break
            seq.scheduled_step = -1
        if self.caching:
            self._cache_blocks(seq, seq.num_computed_tokens)  # for its own return, and others
        self.block_manager.free(seq.seq_id)
        seq.status = _WAITING
        seq.num_computed_tokens = 0
        seq.num_slots = 0
        seq.num_preemptions += 1
        seq.preempted = True
        self.num_preempted_waiting += 1
        self._num_running -= 1
        self._running_dirty = True
        self.num_preempted_total += 1
        self._preempted_ids.append(seq.seq_id)  # running implies sent
        self._requeue.append(seq)  # queued once the plan is built: not re-admitted in it

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort_right(self.waiting, seq, key=self.policy.key)

    # ------------------------------------------------------------ results

    def process_result(self, result: StepResult, tokens: list[int]) -> list[RequestDelta]:
        """Settle the oldest plan in flight: append its sampled `tokens` (one per
        `result.seq_ids`), finish sequences, free their blocks; the deltas for the frontend."""
        inflight = self._inflight_steps
        if not inflight or inflight[0] != result.step:
            expected = inflight[0] if inflight else None
            raise ValueError(f"result of step {result.step}, expected {expected}")
        inflight.popleft()
        self.last_worker_idle_time = result.idle_time
        self.num_steps_total += 1
        self.worker_busy_total += result.forward_time
        self.worker_idle_total += result.idle_time
        deltas, self._pending = self._pending, []
        get = self._seqs.get
        append = deltas.append
        extras = result.logprobs is not None or result.prompt_logprobs is not None
        i = -1
        for sid, tok in zip(result.seq_ids, tokens, strict=True):
            i += 1
            seq = get(sid)
            if seq is None:
                continue  # finished or aborted after the plan was made
            seq.num_inflight -= 1
            seq.output_ids.append(tok)
            n = seq.num_tokens = seq.num_tokens + 1
            if tok in seq.stop_ids:
                reason = "stop"
            elif n >= seq.token_limit:
                reason = "length"
            else:
                reason = None
            first = not seq.reported
            if first:
                delta = self._first_delta(seq, tok, reason)
            else:
                delta = RequestDelta(seq.request_id, [tok], reason)
            if extras:
                _attach_logprobs(delta, result, i, first)
            append(delta)
            if reason is not None:
                self._finish(seq, reason)
        if self._deferred:
            step = result.step
            deltas.extend(d for after, d in self._deferred if after <= step)
            self._deferred = [item for item in self._deferred if item[0] > step]
        return deltas

    def _first_delta(self, seq: Sequence, tok: int, reason: str | None) -> RequestDelta:
        """A request's first delta: with its prompt length, cached tokens and queue time."""
        seq.reported = True
        seq.first_token_time = self.clock()
        delta = RequestDelta(
            seq.request_id,
            [tok],
            reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )
        if seq.first_scheduled_time is not None:
            delta.queue_time = max(0.0, seq.first_scheduled_time - seq.arrival_time)
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is _RUNNING:
            self._num_running -= 1
            self._running_dirty = True
            if self.caching:
                self._cache_blocks(seq, seq.num_computed_tokens)  # for later turns of a chat
            self.block_manager.free(seq.seq_id)
            seq.num_slots = 0
        elif seq.status is _WAITING:
            self.waiting.remove(seq)
            if seq.seq_id in self._preempted_ids:
                self._preempted_ids.remove(seq.seq_id)
            if seq.preempted:
                seq.preempted = False
                self.num_preempted_waiting -= 1
        seq.status = _FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        del self._by_request[seq.request_id]
        if seq.sent:
            self._finished_ids.append(seq.seq_id)
        self.num_finished_total += 1

    # ------------------------------------------------------------ invariants

    def check(self) -> None:
        """Verify the scheduler's invariants against the block manager's (for tests)."""
        bm = self.block_manager
        bm.check()
        running = [s for s in self.running if s.status is _RUNNING]
        if len(running) != self._num_running or len({id(s) for s in running}) != len(running):
            raise AssertionError("the running list and count disagree")
        if self._num_running > self.max_num_seqs:
            raise AssertionError(f"{self._num_running} running, cap {self.max_num_seqs}")
        if any(s.status is not _WAITING for s in self.waiting):
            raise AssertionError("a sequence in the waiting queue is not waiting")
        key = self.policy.key
        if any(key(a) > key(b) for a, b in zip(self.waiting, self.waiting[1:], strict=False)):
            raise AssertionError("the waiting queue is out of order")
        if sum(s.preempted for s in self.waiting) != self.num_preempted_waiting:
            raise AssertionError("num_preempted_waiting is off")
        for s in running:
            sid = s.seq_id
            if bm.num_tokens(sid) != s.num_computed_tokens:
                raise AssertionError(f"seq {sid}: claims {bm.num_tokens(sid)} slots, "
                                     f"computed {s.num_computed_tokens}")  # fmt: skip
            if s.num_slots != bm.block_size * len(bm.block_table(sid)):
                raise AssertionError(f"seq {sid}: num_slots {s.num_slots} is off")
        for s in self.waiting:
            if bm.block_table(s.seq_id):
                raise AssertionError(f"waiting seq {s.seq_id} holds blocks")

    # ------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        """`kv_blocks_used` counts blocks held by live requests; `kv_blocks_cached` counts
        cached blocks nobody holds, which are evictable and part of `kv_blocks_free`."""
        bm = self.block_manager
        return EngineStats(
            step=self._next_step,
            num_running=self._num_running,
            num_waiting=len(self.waiting),
            num_preempted_total=self.num_preempted_total,
            batch_size=self.last_batch_size,
            num_batched_tokens=self.last_num_batched_tokens,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries_total=self.prefix_queries_total,
            prefix_cache_hits_total=self.prefix_hits_total,
            scheduler_time=self.last_schedule_time,
            worker_idle_time=self.last_worker_idle_time,
            step_time=self.last_step_time,
            num_steps_total=self.num_steps_total,
            worker_busy_time_total=self.worker_busy_total,
            worker_idle_time_total=self.worker_idle_total,
            scheduler_time_total=self.schedule_time_total,
        )


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
