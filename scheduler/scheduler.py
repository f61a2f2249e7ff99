"""The scheduler's logic: queues, token budget, KV blocks, preemption; one `Plan` per step.

Pure Python with no sockets: the process loop (`process.py`) and the offline
engine feed it requests and step results and send the plans it makes.

Overlap: `schedule()` may run again before the result of the previous plan
arrives. A sequence whose sampled token is still in flight is assumed to
continue, so its next decode starts one position further; results then come
in plan order and settle what really happened. A sequence found finished at
result N was also planned in N+1 (already sent): that token is discarded, and
its blocks, freed at once, go to plan N+2 at the earliest. That is safe because
workers run plans in order. Blocks of a sequence preempted while plan N+1 is
built may even go to N+1 itself: plan N, which still writes to them, runs first.

Preemption is by recompute. A preempted sequence keeps any token already in
flight: it was computed with intact KV, and the workers append every token
they sample to their copy of the sequence, so both sides stay in agreement.
It is admitted again only when nothing of it is in flight, re-prefilled from
position 0 over prompt + output.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

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
from subway.scheduler.block_manager import BlockManager
from subway.scheduler.policy import make_policy
from subway.scheduler.request import SeqStatus, Sequence

_WAITING = SeqStatus.WAITING
_RUNNING = SeqStatus.RUNNING
_FINISHED = SeqStatus.FINISHED


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: list[int],
    ) -> None:
        self.config = config
        self.block_manager = BlockManager(num_blocks, config.block_size)
        pool = self.block_manager.capacity_tokens
        # A sequence must fit in the pool alone, or it could never finish.
        self.max_model_len = min(max_model_len, pool) if max_model_len > 0 else pool
        self.eos_token_ids = list(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.policy = make_policy(config.policy)
        self.max_num_batched_tokens = max(1, config.max_num_batched_tokens)
        # Every running sequence gets its decode each step: no more running than the budget.
        self.max_num_seqs = max(1, min(config.max_num_seqs, self.max_num_batched_tokens))
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

        self.num_preempted_total = 0
        self.num_finished_total = 0
        self.last_batch_size = 0
        self.last_num_batched_tokens = 0
        self.last_schedule_time = 0.0
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
    def has_work(self) -> bool:
        """Something waits, runs, or has a plan in flight."""
        return bool(self.waiting or self._num_running or self._inflight_steps)

    @property
    def has_pending_deltas(self) -> bool:
        return bool(self._pending)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_request.get(request_id)

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
            prompt_ids=prompt_ids,
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
        delta = RequestDelta(
            request_id, [], "abort", num_prompt_tokens=0 if seq.reported else seq.prompt_len
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
        if policy.dynamic and len(self.waiting) > 1:
            policy.refresh(time.time())
            self.waiting.sort(key=policy.key)
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        steps: list[SeqStep] = []
        new_seqs: list[NewSeq] = []
        preempted = self._preempted_ids
        num_preempted_before = len(preempted)

        # 1. Decodes: one token each, from the token sampled last step (maybe still in flight).
        for seq in self.running:
            if seq.status is not _RUNNING:
                continue
            inflight = seq.num_inflight
            total = seq.num_tokens + inflight
            pos = seq.num_computed_tokens
            if total - pos != 1 or total >= seq.token_limit:
                continue  # a prefill, or its last token is already in flight
            sid = seq.seq_id
            try:
                new_blocks = bm.allocate(sid, 1)
            except MemoryError:
                if not self._make_room(seq, 1, step, preempted):
                    continue
                new_blocks = bm.allocate(sid, 1)
            steps.append(SeqStep(sid, pos, 1, new_blocks, True))
            seq.num_computed_tokens = pos + 1
            seq.num_inflight = inflight + 1
            seq.scheduled_step = step
            budget -= 1
            if budget == 0:
                break

        # 2. Next prefill chunks of running sequences.
        if budget > 0:
            for seq in self.running:
                if seq.status is not _RUNNING or seq.scheduled_step == step:
                    continue
                pos = seq.num_computed_tokens
                remaining = seq.num_tokens + seq.num_inflight - pos
                if remaining <= 1:
                    continue
                sid = seq.seq_id
                n = remaining if remaining < budget else budget
                fit = bm.max_new_tokens(sid)
                if fit < n:
                    if fit <= 0:  # preempt for one block at least, then take what fits
                        if not self._make_room(seq, 1, step, preempted):
                            continue
                        fit = bm.max_new_tokens(sid)
                    n = fit if fit < n else n  # a smaller chunk rather than more preemption
                sample = n == remaining
                steps.append(SeqStep(sid, pos, n, bm.allocate(sid, n), sample))
                seq.num_computed_tokens = pos + n
                if sample:
                    seq.num_inflight += 1
                seq.scheduled_step = step
                budget -= n
                if budget == 0:
                    break

        # 3. Admit waiting sequences, unless this step had to preempt.
        if (
            budget > 0
            and self.waiting
            and len(preempted) == num_preempted_before
            and policy.can_admit(self._num_running)
        ):
            budget = self._admit(step, budget, steps, new_seqs)

        if not steps:
            return None
        plan = Plan(step, steps, new_seqs, self._finished_ids, preempted)
        self._finished_ids = []
        self._preempted_ids = []
        self._next_step = step + 1
        self._inflight_steps.append(step)
        self.last_batch_size = len(steps)
        self.last_num_batched_tokens = self.max_num_batched_tokens - budget
        self.last_schedule_time = time.perf_counter() - t0
        return plan

    def _admit(self, step: int, budget: int, steps: list[SeqStep], new_seqs: list[NewSeq]) -> int:
        """Admit waiting sequences in policy order while the budget, the cap and blocks allow."""
        bm = self.block_manager
        cap = self.max_num_seqs
        watermark = self.watermark_blocks if self._num_running else 0
        admitted = 0
        skipped = False
        for seq in self.waiting:
            if budget == 0 or self._num_running >= cap:
                break
            if seq.num_inflight:  # preempted with a token in flight: wait for it
                skipped = True
                continue
            sid = seq.seq_id
            remaining = seq.num_tokens
            n = remaining if remaining < budget else budget
            if bm.blocks_needed(sid, n) + watermark > bm.num_free_blocks:
                break  # no overtaking: the head waits for blocks
            new_blocks = bm.allocate(sid, n)
            seq.status = _RUNNING
            self.running.append(seq)
            self._num_running += 1
            if not seq.sent:
                new_seqs.append(NewSeq(sid, seq.prompt_ref, seq.sampling))
                seq.sent = True
            sample = n == remaining
            steps.append(SeqStep(sid, 0, n, new_blocks, sample))
            seq.num_computed_tokens = n
            if sample:
                seq.num_inflight = 1
            seq.scheduled_step = step
            budget -= n
            admitted += 1
        if admitted:
            if skipped:
                self.waiting = [s for s in self.waiting if s.status is _WAITING]
            else:
                del self.waiting[:admitted]
        return budget

    def _make_room(self, seq: Sequence, n: int, step: int, preempted: list[int]) -> bool:
        """Preempt until `seq` can claim `n` more tokens; False if `seq` itself was preempted.

        Victims are running sequences not yet scheduled in this step (`seq`
        included), chosen by the policy.
        """
        bm = self.block_manager
        while not bm.can_allocate(seq.seq_id, n):
            candidates = [
                s for s in self.running if s.status is _RUNNING and s.scheduled_step != step
            ]
            victim = self.policy.pick_victim(candidates)
            self._preempt(victim, preempted)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, preempted: list[int]) -> None:
        self.block_manager.free(seq.seq_id)
        seq.status = _WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_running -= 1
        self._running_dirty = True
        self.num_preempted_total += 1
        preempted.append(seq.seq_id)  # running implies sent
        self._enqueue(seq)

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
        deltas, self._pending = self._pending, []
        seqs = self._seqs
        logprobs = result.logprobs
        now = time.time()
        for i, sid in enumerate(result.seq_ids):
            seq = seqs.get(sid)
            if seq is None:
                continue  # finished or aborted after the plan was made
            tok = tokens[i]
            seq.num_inflight -= 1
            seq.output_ids.append(tok)
            seq.num_tokens += 1
            if tok in seq.stop_ids:
                reason = "stop"
            elif seq.num_tokens >= seq.token_limit:
                reason = "length"
            else:
                reason = None
            if seq.reported:
                delta = RequestDelta(seq.request_id, [tok], reason)
            else:
                seq.reported = True
                seq.first_token_time = now
                delta = RequestDelta(
                    seq.request_id, [tok], reason, num_prompt_tokens=len(seq.prompt_ids)
                )
            if logprobs is not None:
                delta.logprobs = [logprobs[i]]
                if result.top_ids is not None:
                    delta.top_ids = [result.top_ids[i]]
                if result.top_logprobs is not None:
                    delta.top_logprobs = [result.top_logprobs[i]]
            deltas.append(delta)
            if reason is not None:
                self._finish(seq, reason)
        if self._deferred:
            step = result.step
            deltas.extend(d for after, d in self._deferred if after <= step)
            self._deferred = [item for item in self._deferred if item[0] > step]
        return deltas

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is _RUNNING:
            self._num_running -= 1
            self._running_dirty = True
        elif seq.status is _WAITING:
            self.waiting.remove(seq)
            if seq.seq_id in self._preempted_ids:
                self._preempted_ids.remove(seq.seq_id)
        seq.status = _FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.seq_id)
        del self._seqs[seq.seq_id]
        del self._by_request[seq.request_id]
        if seq.sent:
            self._finished_ids.append(seq.seq_id)
        self.num_finished_total += 1

    # ------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
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
            scheduler_time=self.last_schedule_time,
            worker_idle_time=self.last_worker_idle_time,
            step_time=self.last_step_time,
        )
