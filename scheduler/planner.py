"""Planning one step: decodes first, then prefill chunks and admissions in policy order,
within the token budget; preemption when KV blocks run out. One `Plan` per call.

A step. Every running request that decodes gets its one token first (while
the budget lasts; `max_num_seqs` never exceeds the budget, so all do). Then
the rest of the `max_num_batched_tokens` budget goes, in the policy's order,
to the next prefill chunks of running requests and to admissions from the
waiting queue: each request gets at most one chunk per step, the last one
may be partial. Admission stops at the first waiting request that does not
fit (no overtaking), unless the policy lets it preempt running work.

Overlap: `schedule()` may run again before the result of the previous plan
arrives. A request whose sampled token is still in flight is assumed to
continue, so its next decode starts one position further; results then come
in plan order and settle what really happened (`settle.py`). A request found
finished at result N was also planned in N+1 (already sent): that token is
discarded, and its blocks, freed at once, go to plan N+2 at the earliest. That
is safe because workers run plans in order. Blocks of a request preempted while
plan N+1 is built may even go to N+1 itself: plan N, which still writes to them,
runs first.

Preemption is by recompute. The policy picks the victim among the running
requests not admitted in this step; one already placed in this plan is taken
out of it again. A preempted request keeps any token already in flight: it
was computed with intact KV, and the workers append every token they sample
to their copy of the sequence, so both sides stay in agreement. It is
admitted again only when nothing of it is in flight, re-prefilled over
prompt + output (from its cached prefix, if the prefix cache still has it).

Prefix caching (`enable_prefix_caching`). A full block is keyed in the cache
(see `block_manager.py`) only once a sent plan has computed all of it, never
in the plan that computes it, so a hit always reads KV that an earlier plan
wrote: the blocks a prefill fills are keyed when the request is next
scheduled (its next chunk or its first decode), so that requests arriving
meanwhile share them; the blocks it fills while decoding are keyed when it
finishes or is preempted (for the next turn of a chat, or its own return),
which costs nothing per decode step. An admission looks up the longest cached
prefix of its tokens, at most `(length - 1) // block_size` blocks so that
the last token is computed, and its first `SeqStep` starts there: `start_pos`
= cached tokens, `new_blocks` = its whole table, cached blocks first. Shared
blocks are full and never written again, so there is no copy-on-write.
"""

from __future__ import annotations

from subway.ipc.config import SchedulerConfig
from subway.ipc.messages import NewSeq, SeqStep
from subway.scheduler.planned import Planned, Queues
from subway.scheduler.policy import StepView
from subway.scheduler.request import NEVER, Request, RequestStatus
from subway.scheduler.speculative import propose

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING

# _admit outcomes
_ADMITTED, _SKIPPED, _BLOCKED = 1, 0, -1
# Every PROBE_EVERY-th step that decodes leaves pooled prompts out (`_pooling_room`).
PROBE_EVERY = 8


class Planner:
    """Makes the plans of one scheduler: changes the requests it plans and the block
    manager's tables, and reports the rest (`Planned`) for the scheduler to apply."""

    def __init__(self, queues: Queues, config: SchedulerConfig, max_message_bytes: int) -> None:
        self.queues = queues
        self.max_num_batched_tokens = max(1, config.max_num_batched_tokens)
        # Every running request gets its decode each step: no more running than the budget.
        self.max_num_seqs = max(1, min(config.max_num_seqs, self.max_num_batched_tokens))
        # Keep a few blocks for running requests to grow into when admitting more.
        self.watermark_blocks = queues.block_manager.num_blocks // 100
        # While a plan is built: its outcome so far, budget given back by requests taken out
        # of it, and whether it preempted (admission is then off for the step).
        self._out = Planned()
        self._released = 0
        self._preempted = False
        # The policy's cap on a step's tokens once a batch prefill chunk joins it (None: no
        # cap) and the batch chunks given so far.
        self._cap: int | None = None
        self._batch_chunks = 0
        # A plan's NewSeqs stay within half the message limit (the rest is room for the
        # steps): admission stops before a plan would pass it, so no plan is refused.
        self.max_new_seq_bytes = max_message_bytes // 2
        self._new_seq_bytes = 0
        # Tokens pooled prompts may still take in the step being built (None: no limit).
        share = min(max(config.pooling_share, 0.0), 0.95)
        self.pooling_ratio = share / (1.0 - share)  # their time over the decodes' time
        self._pool_room: int | None = None

    def plan(self, step: int) -> Planned:
        """Plan step number `step` over the scheduler's queues (its waiting list sorted in
        policy order) and its compacted running list."""
        q = self.queues
        policy = q.policy
        policy.begin_step(
            StepView(
                q.clock, q.waiting, q.running, q.num_running, q.num_interactive,
                self.max_num_seqs, self.max_num_batched_tokens, q.step_cost, q.stats,
            )
        )  # fmt: skip
        out = self._out = Planned()
        self._cap = None
        self._batch_chunks = 0
        self._new_seq_bytes = 0
        self._preempted = False
        prefills: list[Request] = []
        budget = self._decodes(step, self.max_num_batched_tokens, prefills)
        decoded = out.decode_tokens = self.max_num_batched_tokens - budget
        self._pool_room = self._pooling_room(step, decoded, out.decode_kv) if decoded else None
        if budget > 0 and (prefills or q.waiting):
            self._cap = policy.batch_chunk_cap(self.max_num_batched_tokens - budget, out.decode_kv)
            budget = self._prefill_and_admit(step, budget, prefills, not self._preempted)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _decodes(self, step: int, budget: int, prefills: list[Request]) -> int:
        """1. Decodes: one token each, from the token sampled last step (maybe still in
        flight), and a draft after it where speculation is on (see `speculative.py`).
        Running requests with more than one token to compute go to `prefills`; returns the
        budget left."""
        q = self.queues
        out = self._out
        steps = out.steps
        bm = q.block_manager
        claimed = bm.claimed
        spec = q.speculative
        spec_on = spec is not None and q.num_running <= spec.disable_by_batch_size
        spare = budget - q.num_running  # budget for drafts once every decode has its token
        decode_kv = 0
        for req in q.running:
            if req.status is not _RUNNING:
                continue
            inflight = req.num_inflight
            if inflight and (req.num_draft or (spec_on and req.speculable)):
                continue  # its next position, or its next draft, waits for that result
            total = req.length + inflight
            pos = req.num_computed_tokens
            if total - pos != 1:
                if total - pos > 1:
                    prefills.append(req)
                continue  # or its last token is already in flight
            if total >= req.token_limit:
                continue  # its last token is already in flight
            sid = req.seq_id
            if pos >= req.cache_upto:  # its first decode: key what its prefill computed
                bm.cache_blocks(sid, req.prompt_ids, req.output_ids, pos, -req.lora)  # tokens < pos
                req.cache_upto = NEVER  # what it decodes is keyed when it finishes or is preempted
            draft: list[int] = []
            if spec_on and req.speculable and spare > 0:
                k = min(spec.num_speculative_tokens, req.token_limit - total - 1, spare)
                if k > 0:
                    draft = propose(
                        req.prompt_ids, req.output_ids, k,
                        spec.prompt_lookup_max, spec.prompt_lookup_min,
                    )  # fmt: skip
                    if draft and not bm.can_allocate(sid, 1 + len(draft)):
                        draft = []  # never preempt for a draft
                    spare -= len(draft)
            n = 1 + len(draft)
            if pos + n <= req.num_slots:  # its last block has room: no allocation
                claimed[sid] = pos + n
                new_blocks = []
            else:
                try:
                    new_blocks = bm.allocate(sid, n)
                except MemoryError:
                    if not self._make_room(req, 1, step):
                        continue
                    budget += self._take_released()
                    new_blocks = bm.allocate(sid, n)
                req.num_slots += bm.slots(new_blocks)
            steps.append(SeqStep(sid, pos, n, new_blocks, True, draft))
            decode_kv += pos + n
            req.num_computed_tokens = pos + n
            req.num_inflight = inflight + 1
            req.num_draft = n - 1
            req.scheduled_step = step
            budget -= n
            if budget <= 0:
                break
        out.decode_kv = decode_kv
        return budget

    def _prefill_and_admit(
        self,
        step: int,
        budget: int,
        prefills: list[Request],
        admitting: bool,
    ) -> int:
        """Give the budget to running prefills and waiting requests, merged in policy order;
        returns the budget left. Admission stops at the first waiting request that cannot
        be admitted, and is off for the step once it had to preempt for blocks."""
        q = self.queues
        key = q.policy.key
        waiting = q.waiting
        if len(prefills) > 1:
            prefills.sort(key=key)
        nw, npf = len(waiting), len(prefills)
        wi = pi = 0
        admitted = 0
        passed = False  # a waiting request was passed over (it stays)
        scattered = False  # and one after it was admitted: the admitted are not a prefix
        admitting = admitting and nw > 0
        while budget > 0:
            if admitting and wi < nw and (pi == npf or key(waiting[wi]) < key(prefills[pi])):
                req = waiting[wi]
                wi += 1
                outcome, budget = self._admit(req, step, budget)
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
            req = prefills[pi]
            pi += 1
            if req.status is _RUNNING:  # (not preempted in this step)
                budget, made_room = self._next_chunk(req, step, budget)
                admitting = admitting and not made_room
        self._out.num_admitted = admitted
        self._out.scattered = scattered
        return budget

    def _pooling_room(self, step: int, decoded: int, decode_kv: int) -> int | None:
        """The tokens pooled prompts may take in a step that decodes: `--pooling-share` of
        its time by the step cost model (a prefill token costs a pass through the weights'
        compute, so a steady embeddings load would otherwise fill every step and multiply
        its decodes' time), one block at least, so that they keep moving; alone (no
        decodes) they take the whole budget. Every `PROBE_EVERY`-th step gives them none:
        under a steady load every step would otherwise mix decodes and prefill alike, and
        the cost model could not tell a prefill token's cost from the step's base (its
        prefill price came out at half the true one, measured), so the room grew."""
        if not self.pooling_ratio:
            return None
        if step % PROBE_EVERY == 0:
            return 0
        cost = self.queues.step_cost
        decode_s = cost.predict(decoded, decode_kv, decodes=decoded)
        room = int(self.pooling_ratio * decode_s / cost.per_token) if cost.per_token > 0 else 0
        return max(room, self.queues.block_manager.block_size)

    def _next_chunk(self, req: Request, step: int, budget: int) -> tuple[int, bool]:
        """Plan running `req`'s next prefill chunk: (budget left, whether it had to preempt
        for a block, which ends admission for the step)."""
        q = self.queues
        bm = q.block_manager
        pos = req.num_computed_tokens
        remaining = req.length + req.num_inflight - pos
        sid = req.seq_id
        n = self._chunk(req, remaining if remaining < budget else budget, budget)
        if n == 0:
            return budget, False
        if pos >= req.cache_upto:  # (before a window releases what it computed)
            q.cache_blocks(req, pos)
        made_room = False
        fit = bm.max_new_tokens(sid)
        if fit < n:
            if fit <= 0:  # preempt for one block at least, then take what fits
                made_room = True
                if not self._make_room(req, 1, step):
                    return budget, True
                budget += self._take_released()
                n = remaining if remaining < budget else budget
                fit = bm.max_new_tokens(sid)
            n = fit if fit < n else n  # a smaller chunk rather than more preemption
        if self._pool_room is not None and req.sampling.pooling:
            self._pool_room -= n
        sample = n == remaining
        new_blocks = bm.allocate(sid, n)
        req.num_slots += bm.slots(new_blocks)
        self._out.steps.append(SeqStep(sid, pos, n, new_blocks, sample))
        req.num_computed_tokens = pos + n
        if sample:
            req.num_inflight += 1
        req.scheduled_step = step
        return budget - n, made_room

    def _chunk(self, req: Request, n: int, budget: int) -> int:
        """A chunk of `n` tokens for `req` cut to the step's caps: the policy's for batch
        work, `_pooling_room` for pooled prompts."""
        if self._cap is not None and req.slo_class == "batch":
            n = self._capped_chunk(n, budget)
        if self._pool_room is not None and req.sampling.pooling and n > self._pool_room:
            n = self._pool_room
            self._out.pool_limited = True
        return n

    def _admit(self, req: Request, step: int, budget: int) -> tuple[int, int]:
        """Admit one waiting request with its first chunk: (_ADMITTED, budget left), or
        _SKIPPED (not now, try the next one) or _BLOCKED (stop admitting)."""
        q = self.queues
        if req.num_inflight:  # preempted with a token in flight: wait for it
            return _SKIPPED, budget
        if not q.policy.can_admit(req):
            return _SKIPPED, budget
        if req.lora and not q.loras.can_run(req.lora):
            return _BLOCKED, budget  # --max-loras others run: theirs drain first (lora.py)
        if not req.sent and self._new_seq_bytes + req.wire_bytes > self.max_new_seq_bytes:
            return _BLOCKED, budget  # the plan is full: the next one takes it
        while q.num_running >= self.max_num_seqs:
            if not self._displace(req, step):
                return _BLOCKED, budget
            budget += self._take_released()
        bm = q.block_manager
        bs = bm.block_size
        total = req.length
        # A request that wants its prompt's logprobs, or its hidden states pooled, computes
        # the whole prompt.
        if q.caching and req.sampling.prompt_logprobs is None and not req.sampling.pooling:
            hits = bm.lookup(req.prompt_ids, req.output_ids, (total - 1) // bs, -req.lora)
        else:
            hits = []
        cached = bm.slots(hits)
        remaining = total - cached
        while True:
            n = self._chunk(req, remaining if remaining < budget else budget, budget)
            if n == 0:  # full for batch work (later keys wait too), or for pooled prompts
                return (_SKIPPED if req.sampling.pooling else _BLOCKED), budget
            watermark = self.watermark_blocks if q.num_running else 0
            if bm.admission_cost(hits, n) + watermark <= bm.num_free_blocks:
                break
            if not self._displace(req, step):  # no overtaking: the head waits for blocks
                return _BLOCKED, budget
            budget += self._take_released()
        sid = req.seq_id
        if self._pool_room is not None and req.sampling.pooling:
            self._pool_room -= n
        table = bm.allocate_with_prefix(sid, hits, n)
        req.num_slots = bm.slots(table)
        q.mark_running(req)
        if not req.sent:
            self._out.new_seqs.append(NewSeq(sid, req.prompt_ref, req.sampling, req.lora))
            self._new_seq_bytes += req.wire_bytes
            req.sent = True
        sample = n == remaining
        self._out.steps.append(SeqStep(sid, cached, n, table, sample))
        req.num_computed_tokens = cached + n
        if sample:
            req.num_inflight = 1
        req.scheduled_step = step
        req.admitted_step = step
        stats = q.stats
        if q.caching:
            req.cache_upto = cached + bs
            stats.prefix_queries_total += total
            stats.prefix_hits_total += cached
        if not req.reported:
            req.num_cached_tokens = cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = q.clock()
        return _ADMITTED, budget - n

    def _capped_chunk(self, n: int, budget: int) -> int:
        """A batch chunk of `n` tokens cut to the policy's step cap; the step's first batch
        chunk gets one block at least (batch prompts keep moving), the others may get 0."""
        room = self._cap - (self.max_num_batched_tokens - budget)
        bs = self.queues.block_manager.block_size
        if room < bs and not self._batch_chunks:
            room = bs
        if n > room:
            n = max(room, 0)
            self._out.capped = True
        if n:
            self._batch_chunks += 1
        return n

    def _take_released(self) -> int:
        n, self._released = self._released, 0
        return n

    def _make_room(self, req: Request, n: int, step: int) -> bool:
        """Preempt until `req` can claim `n` more tokens; False if `req` itself was preempted.

        Victims are running requests not admitted in this step (`req`
        included), chosen by the policy; budget they give back is in `_released`.
        """
        q = self.queues
        bm = q.block_manager
        while not bm.can_allocate(req.seq_id, n):
            candidates = [r for r in q.running if r.status is _RUNNING and r.admitted_step != step]
            victim = q.policy.pick_victim(candidates)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _displace(self, req: Request, step: int) -> bool:
        """Preempt one running request that the policy lets waiting `req` displace; False if
        there is none."""
        policy = self.queues.policy
        if not policy.preemptive:
            return False
        may = policy.may_preempt
        candidates = [
            r
            for r in self.queues.running
            if r.status is _RUNNING and r.admitted_step != step and may(req, r)
        ]
        if not candidates:
            return False
        stats = self.queues.stats
        if not policy.must_displace(req):
            stats.slo_waits_total += 1
            return False
        self._preempt(policy.pick_displaced(candidates), step)
        stats.num_displaced_total += 1
        return True

    def _preempt(self, req: Request, step: int) -> None:
        if req.scheduled_step == step:  # take it out of the plan being built
            steps = self._out.steps
            sid = req.seq_id
            for i in range(len(steps) - 1, -1, -1):
                st = steps[i]
                if st.seq_id == sid:
                    del steps[i]
                    self._released += st.num_tokens
                    req.num_computed_tokens = st.start_pos
                    if st.sample:
                        req.num_inflight -= 1
                    req.num_draft = 0
                    break
            req.scheduled_step = -1
        self.queues.preempt(req)
        self._preempted = True
        self._out.requeue.append(req)  # queued once the plan is built: not re-admitted in it
