"""The scheduler's link to its workers: plans out, results in. The `EngineCore` executor of
the worker processes.

    XPUB  config.ipc.plan_addr    -> workers  (ToWorker; XPUB so that subscriptions are seen)
    PULL  config.ipc.result_addr  <- workers  (FromWorker)

No plan goes out before `tensor_parallel_size` subscriptions and as many
WorkerReady messages have arrived: a PUB socket drops what it sends before a
subscriber has joined.

What arrives is checked before use: a result must answer the oldest plan in
flight, for sequences that plan sampled, with token ids inside the vocabulary
and lists of matching lengths; a WorkerReady must name a rank of this engine.
Anything else is dropped and counted (`rejected`), logged once per kind.

The engine cannot serve (`failure`) when a worker says so (WorkerError), when
a known worker process has died (judged by its pid on this host, on any
unsubscription and every `PEER_CHECK_S`: never by a socket event alone, which
a stray connection causes too), or when the oldest plan in flight has made no
progress for longer than its bound (a hung worker: stopped, deadlocked in a
collective, stuck in a kernel).

The bound is `--step-timeout` where it is given; by default (0) it follows the
plan: max(`HUNG_MIN_S`, `HUNG_FACTOR` x the scheduler's `StepCost` prediction
for that plan), or, before the cost model has seen a few steps, `cold_bound`
(see `hung_bound`). A hung rank is then declared within seconds of its last
result (10 s for any plan the model predicts under half a second), and a step
the model expects to be slow (a long prefill chunk on a loaded CPU) gets twenty
times what it should take. Nothing is computed for it while the oldest plan is
younger than the floor: the check costs a subtraction a turn.

Where every worker runs on this host's CPU, the scheduler can also see whether they
work (`WorkWatch`: each worker's CPU time and state, read from /proc once a
`PEER_CHECK_S` while a plan is in flight). A CPU step, however slow on a loaded
machine, burns CPU time all along; a stopped worker, or ranks blocked in a
deadlocked collective, burn none. So with the adaptive bound, a plan that has made
no progress for `HUNG_MIN_S` while no worker has shown a sign of work (CPU time, a
running or disk-waiting state) for as long is hung too, whatever its prediction:
on the machine where steps are slowest, a stopped worker is still declared in
10-11 s, and a slow step is still given its twenty predictions. The same signs, for
workers of any device on this host, stretch the bound of the first steps (see
`hung_bound`).

An idle engine sends no plan, so no step can time out: there the same samples (taken
every `PEER_CHECK_S`, idle or not) declare a worker that has been stopped by a signal
(state "T") for `HUNG_MIN_S` (`_check_idle`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.kv_groups import MAX_KV_GROUPS, check_windows
from subway.ipc.messages import (
    MAX_EMBEDDING_BYTES,
    MAX_EXPERTS,
    Codec,
    FromWorker,
    GrammarPrepare,
    GrammarReady,
    GrammarRelease,
    KvImport,
    KvImported,
    Plan,
    Shutdown,
    StepResult,
    ToWorker,
    WorkerError,
    WorkerReady,
)
from subway.ipc.peers import Refusals, process_alive
from subway.ipc.shm import TokenBuffer, resolve
from subway.ipc.sockets import Sockets, cleanup_ipc, has_message
from subway.scheduler.slo import StepCost
from subway.scheduler.work_watch import PEER_CHECK_S, WorkWatch

log = logging.getLogger("subway.scheduler")

LINGER_MS = 1000  # time left to deliver Shutdown on close
HUNG_MIN_S = 10.0  # the adaptive bound on a step's progress: at least this,
HUNG_FACTOR = 20.0  # and at least this many times the step's predicted time
COLD_S = 20.0  # before the cost model is ready: this, plus HUNG_FACTOR x its prior's figure
COLD_BUSY_S = 300.0  # or this, while the workers show signs of work (`WorkWatch`)
_PRIOR = StepCost()  # a model that has seen no step: its prior coefficients


def hung_bound(plan: Plan, cost: StepCost | None, working: bool = False) -> tuple[float, str]:
    """Seconds the workers may spend on `plan` (from the previous result, or from its
    submission into an empty pipeline) before they count as hung; and how that was found.
    `working`: the workers show signs of work now (`WorkWatch`).

    With a cost model that has seen `StepCost.warmup` steps: max(`HUNG_MIN_S`,
    `HUNG_FACTOR` x its prediction for the plan). The plan's tokens are what it computes;
    the context its decodes read is taken as every sequence's `start_pos + num_tokens`
    (prefill chunks included, so at least what the planner counted): a bound errs long.

    Before that (`cold_bound`), the first steps of a run: they pay costs that no later
    step pays and that no model of the steady state predicts: the first forward of each
    shape builds its oneDNN primitives and, on CUDA, compiles the Triton kernels that the
    start-up's decode graphs did not (seconds each on a cold cache), allocators grow their
    pools, and weight pages not touched yet fault in. Those costs do not grow with the
    plan, and a few seconds cover them on a machine to itself, so the bound is a floor of
    `COLD_S` for them, above the adaptive floor, plus the adaptive rule applied to the
    prior (the coefficients a `StepCost` starts from, about 5,000 tokens a second), so
    that a large first plan gets more: a first plan within the default token budget
    (512) is declared hung after 20-23 s, under the 30 s a client may wait for a stopped
    worker to be noticed. On a machine shared with other work those first steps can
    take longer than that (on 2 cores with a load of 12, a 3-step start of the default
    model took over 20 s): where the workers can be seen working (their CPU time grows:
    compiling, faulting pages in, computing), the first steps are given `COLD_BUSY_S`
    instead, since a stopped or deadlocked worker shows no such sign.
    """
    tokens = kv = 0
    for s in plan.seqs:
        tokens += s.num_tokens
        kv += s.start_pos + s.num_tokens
    if cost is not None and cost.ready:
        predicted = cost.predict(tokens, kv)
        bound = max(HUNG_MIN_S, HUNG_FACTOR * predicted)
        return bound, f"max({HUNG_MIN_S:g} s, {HUNG_FACTOR:g} x its predicted {predicted:.3f} s)"
    if working:
        return COLD_BUSY_S, "a first step, its workers working"
    return cold_bound(tokens, kv), f"a first step: {COLD_S:g} s + {HUNG_FACTOR:g} x the prior"


def cold_bound(tokens: int, decode_kv: int = 0) -> float:
    """The bound on a step of `tokens` tokens before the cost model is ready (`hung_bound`)."""
    return COLD_S + HUNG_FACTOR * _PRIOR.predict(tokens, decode_kv)


class WorkerLink:
    def __init__(self, socks: Sockets, config: EngineConfig) -> None:
        self.config = config
        self.plans = socks.bind(
            zmq.XPUB, config.ipc.plan_addr, XPUB_VERBOSE=1, XPUB_VERBOSER=1, SNDHWM=0
        )  # verbose-r: every (un)subscription, so each worker's arrival and departure show
        self.results = socks.bind(zmq.PULL, config.ipc.result_addr, RCVHWM=0)
        self._in = Codec(FromWorker, config.ipc.max_message_bytes)
        self._out = Codec(ToWorker)
        self.num_subscribers = 0
        self.workers: dict[int, WorkerReady] = {}
        self.started = False  # the engine runs: plans may go out
        self.failure: str | None = None
        self.sampled_buf: TokenBuffer | None = None
        self.vocab_size = 0
        self.refusals = Refusals(log, "a worker")
        self.worker_rejected = 0  # messages rank 0 says it refused
        self.lora_counts = (0, 0, 0)  # rank 0's adapter loads, evictions and bytes, as reported
        self.moe_expert_tokens: list[int] = []  # rank 0's tokens per expert, as reported
        self._results: list[tuple[StepResult, list[int]]] = []
        self._imported: list[KvImported] = []  # KV copies the ranks have answered
        self._grammars: list[GrammarReady] = []  # rank 0's compile answers
        # Plans in flight, oldest first: (step, ids of the sequences it samples, the plan).
        self._inflight: deque[tuple[int, list[int], Plan]] = deque()
        self._progress_at = 0.0  # last result, or the submit that started an empty pipeline
        # The scheduler's step cost model, once it has one (`SchedulerLoop._start`): what
        # the bound on a hung step follows (`hung_bound`). None: the cold bound applies.
        self.step_cost: StepCost | None = None
        self.work = WorkWatch()  # signs of work of the workers, where this host can see them
        self.clock = time.monotonic  # what the bound is measured by (a test may move it)
        self._peers_checked_at = 0.0
        self._prompt_shm = ""  # to name in the next plan: the frontend's new prompt buffer

    def ready_ranks(self) -> list[WorkerReady] | None:
        """Every rank's WorkerReady once all have subscribed and said so, in rank order."""
        tp = self.config.parallel.tensor_parallel_size
        if self.started or self.num_subscribers < tp:
            return None
        if any(rank not in self.workers for rank in range(tp)):
            return None
        return [self.workers[r] for r in range(tp)]

    def start(self, rank0: WorkerReady) -> None:
        """The engine runs from now on; sampled ids are read from rank 0's buffer."""
        if rank0.sampled_shm:
            try:
                self.sampled_buf = TokenBuffer.attach(rank0.sampled_shm)
            except (OSError, ValueError) as e:
                log.error("cannot attach rank 0's sampled-token buffer: %s", e)
        self.vocab_size = rank0.vocab_size
        self.work.watch(list(self.workers.values()))
        self.started = True

    def use_prompts(self, name: str) -> None:
        """A frontend's prompt buffer is now `name`: the next plan tells the workers."""
        self._prompt_shm = name

    @property
    def num_rejected(self) -> int:
        return self.refusals.count + self.worker_rejected

    # ------------------------------------------------------------ the executor

    def submit(self, plan: Plan) -> None:
        if self._prompt_shm:
            plan.prompt_shm, self._prompt_shm = self._prompt_shm, ""
        if not self._inflight:
            self._progress_at = self.clock()
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        self._inflight.append((plan.step, sampled, plan))
        self.plans.send(self._out.encode(plan))

    def send_import(self, msg: KvImport | GrammarPrepare | GrammarRelease) -> None:
        """A KV copy or a grammar for every rank, ordered before the plans sent after it."""
        self.plans.send(self._out.encode(msg))

    def collect_imports(self) -> list[KvImported]:
        out, self._imported = self._imported, []
        return out

    def collect_grammars(self) -> list[GrammarReady]:
        out, self._grammars = self._grammars, []
        return out

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        out, self._results = self._results, []
        return out

    # ------------------------------------------------------------ receiving

    def drain(self) -> None:
        """Read every subscription change and worker message there is, without blocking;
        then judge the workers' health (their pids, the oldest plan's progress)."""
        for sock, handle in ((self.plans, self._on_subscription), (self.results, self._on_msg)):
            while self.failure is None and has_message(sock):
                handle(sock.recv(zmq.NOBLOCK))
        now = self.clock()
        if self.failure is None and now - self._peers_checked_at >= PEER_CHECK_S:
            self._check_peers()
            self.work.sample(now)
            if not self._inflight:
                self._check_idle(now)
        if self.failure is None and self._inflight:
            self._check_progress(now)

    def _check_idle(self, now: float) -> None:
        """With no plan in flight no step can time out, so a worker stopped while its engine
        is idle (a prefill engine between handoffs, say) would be found only by the next
        request, which then waits out a step's bound: a worker of this host seen stopped
        (state "T", SIGSTOP) for `HUNG_MIN_S` is a failure now. A worker hung in another
        way while idle is found by the next plan's bound."""
        stopped = self.work.stopped_for(now)
        if stopped is not None and stopped[1] >= HUNG_MIN_S:
            rank = next((w.rank for w in self.workers.values() if w.pid == stopped[0]), -1)
            self.failure = (
                f"worker {rank} (pid {stopped[0]}) has been stopped for {stopped[1]:.1f} s "
                "while the engine was idle: a worker is hung"
            )

    def _check_progress(self, now: float) -> None:
        """A failure if the oldest plan in flight has made no progress within its bound:
        `--step-timeout`, or, when that is 0, `hung_bound` (computed only once the plan
        has outlived the smallest bound that could apply), or `HUNG_MIN_S` while the
        workers show no sign of work (`WorkWatch`)."""
        stalled = now - self._progress_at
        fixed = self.config.scheduler.step_timeout
        if stalled <= (fixed if fixed > 0 else HUNG_MIN_S):
            return
        step, _, plan = self._inflight[0]
        idle = now - max(self._progress_at, self.work.active_at)
        if fixed > 0:
            bound, how = fixed, f"--step-timeout {fixed:g}"
        elif self.work.cpu and idle > HUNG_MIN_S:
            bound = stalled  # no sign of work: stopped, or blocked in a deadlocked collective
            how = f"no worker has used CPU time for {idle:.1f} s; --step-timeout sets a bound"
        else:
            bound, why = hung_bound(plan, self.step_cost, self.work.working(now))
            how = f"bound {bound:.1f} s: {why}; --step-timeout sets it"
        if stalled >= bound:
            self.failure = (
                f"step {step} made no progress for {stalled:.1f} s ({how}): a worker is hung"
            )

    def _check_peers(self) -> None:
        """A failure if any known worker process has died."""
        self._peers_checked_at = self.clock()
        for w in self.workers.values():
            if process_alive(w.pid, w.host) is False:
                self.failure = f"worker {w.rank} (pid {w.pid}) died"
                return

    def _on_subscription(self, data: bytes) -> None:
        if data[:1] == b"\x01":
            self.num_subscribers += 1
        elif data[:1] == b"\x00":
            self.num_subscribers -= 1
            if self.started:  # a worker, or a stray subscriber: who died?
                self._check_peers()

    def _on_msg(self, data: bytes) -> None:
        try:
            msg = self._in.decode(data)
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            self.refusals.refuse("undecodable", str(e))
            return
        if isinstance(msg, StepResult):
            self._on_result(msg)
        elif isinstance(msg, WorkerReady):
            tp = self.config.parallel.tensor_parallel_size
            bad = check_windows(msg.kv_windows, MAX_KV_GROUPS)
            if bad is None and (self.started or not 0 <= msg.rank < tp):
                bad = f"rank {msg.rank} (started: {self.started})"
            if bad is None and (msg.num_blocks < 1 or msg.vocab_size < 1):
                bad = f"{msg.num_blocks} blocks, a vocabulary of {msg.vocab_size}"
            if bad is not None:
                self.refusals.refuse("bad WorkerReady", bad)
                return
            self.workers[msg.rank] = msg
        elif isinstance(msg, KvImported):
            if not 0 <= msg.rank < self.config.parallel.tensor_parallel_size:
                self.refusals.refuse("bad KvImported", f"rank {msg.rank}")
                return
            self._imported.append(msg)
        elif isinstance(msg, GrammarReady):
            self._grammars.append(msg)
        elif isinstance(msg, WorkerError):
            if not 0 <= msg.rank < self.config.parallel.tensor_parallel_size:
                self.refusals.refuse("bad WorkerError", f"rank {msg.rank}")
                return
            self.failure = f"worker {msg.rank}: {msg.message}"

    def _on_result(self, msg: StepResult) -> None:
        if not self.started or not self._inflight or msg.step != self._inflight[0][0]:
            expected = self._inflight[0][0] if self._inflight else None
            self.refusals.refuse(
                "unexpected step", f"result of step {msg.step}, expected {expected}"
            )
            return
        _, sampled, plan = self._inflight[0]
        try:
            tokens = resolve(msg.tokens, self.sampled_buf)
        except ValueError as e:
            self.refusals.refuse("bad token ref", str(e))
            return
        problem = check_result(msg, tokens, sampled, self.vocab_size, plan)
        if problem is not None:
            self.refusals.refuse("malformed result", f"step {msg.step}: {problem}")
            return
        self._inflight.popleft()
        self._progress_at = self.clock()
        self.worker_rejected = msg.rejected_total
        self.lora_counts = (msg.lora_loads_total, msg.lora_evictions_total, msg.lora_memory_bytes)
        if msg.moe_expert_tokens:
            self.moe_expert_tokens = msg.moe_expert_tokens
        self._results.append((msg, tokens))

    # ------------------------------------------------------------ exit

    def close(self) -> None:
        """Tell the workers to exit; close the sockets and the sampled-token buffer."""
        try:
            self.plans.send(self._out.encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not publish Shutdown: %s", e)
        self.plans.close(linger=LINGER_MS)
        self.results.close(linger=0)
        cleanup_ipc(self.config.ipc.plan_addr, self.config.ipc.result_addr)
        if self.sampled_buf is not None:
            self.sampled_buf.close()
            self.sampled_buf = None


def check_result(
    msg: StepResult, tokens: list[int], sampled: list[int], vocab: int, plan: Plan
) -> str | None:
    """What is wrong with a result for `plan`, which samples `sampled`; or None."""
    n = len(msg.seq_ids)
    m = n  # tokens: one per sequence, or num_tokens each after a draft
    if msg.num_tokens:
        if len(msg.num_tokens) != n:
            return f"{len(msg.num_tokens)} token counts for {n} sequences"
        drafts = {s.seq_id: len(s.draft) for s in plan.seqs if s.draft}
        for sid, c in zip(msg.seq_ids, msg.num_tokens, strict=True):
            if not 1 <= c <= 1 + drafts.get(sid, 0):
                return f"{c} tokens for sequence {sid}, whose draft allows 1 to {1 + drafts.get(sid, 0)}"
        m = sum(msg.num_tokens)
    if len(tokens) != m:
        return f"{len(tokens)} tokens for {m}"
    if msg.seq_ids != sampled and not _subsequence(msg.seq_ids, sampled):
        return "sequences the plan did not sample"
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        return f"a token id outside [0, {vocab})"
    for name in ("logprobs", "top_ids", "top_logprobs"):
        extra = getattr(msg, name)
        if extra is not None and len(extra) != m:
            return f"{len(extra)} {name} for {m} tokens"
    if msg.prompt_logprobs is not None and len(msg.prompt_logprobs) != n:
        return f"{len(msg.prompt_logprobs)} prompt_logprobs for {n} sequences"
    if msg.embeddings is not None and (
        len(msg.embeddings) != n
        or any(
            e is not None and (len(e) % 4 or len(e) > MAX_EMBEDDING_BYTES) for e in msg.embeddings
        )
    ):
        return "embeddings not one per sequence, or not float32 vectors of a bounded size"
    if msg.failed:
        known = {s.seq_id for s in plan.seqs} | {s.seq_id for s in plan.new_seqs}
        if not known.issuperset(msg.failed):
            return "failed sequences the plan did not touch"
    moe = msg.moe_expert_tokens
    if moe and (len(moe) > MAX_EXPERTS or min(moe) < 0):
        return f"{len(moe)} expert token counts, or a negative one (at most {MAX_EXPERTS})"
    return None


def _subsequence(got: list[int], want: list[int]) -> bool:
    """`got` is `want` less some entries (a worker skips the sequences of a failed step)."""
    it = iter(want)
    return all(any(x == y for y in it) for x in got)
