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
progress for `scheduler.step_timeout` seconds (a hung worker: stopped,
deadlocked in a collective, stuck in a kernel).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    Codec,
    FromWorker,
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

log = logging.getLogger("subway.scheduler")

LINGER_MS = 1000  # time left to deliver Shutdown on close
PEER_CHECK_S = 1.0  # how often the workers' pids are checked


class WorkerLink:
    def __init__(self, socks: Sockets, config: EngineConfig) -> None:
        self.config = config
        self.plans = socks.bind(
            zmq.XPUB, config.ipc.plan_addr, XPUB_VERBOSE=1, XPUB_VERBOSER=1, SNDHWM=0
        )  # verbose-r: every (un)subscription, so each worker's arrival and departure show
        self.results = socks.bind(zmq.PULL, config.ipc.result_addr, RCVHWM=0)
        self._in = Codec(FromWorker)
        self._out = Codec(ToWorker)
        self.num_subscribers = 0
        self.workers: dict[int, WorkerReady] = {}
        self.started = False  # the engine runs: plans may go out
        self.failure: str | None = None
        self.sampled_buf: TokenBuffer | None = None
        self.vocab_size = 0
        self.refusals = Refusals(log, "a worker")
        self.worker_rejected = 0  # messages rank 0 says it refused
        self._results: list[tuple[StepResult, list[int]]] = []
        self._imported: list[KvImported] = []  # KV copies the ranks have answered
        # Plans in flight, oldest first: (step, ids of the sequences it samples, the plan).
        self._inflight: deque[tuple[int, list[int], Plan]] = deque()
        self._progress_at = 0.0  # last result, or the submit that started an empty pipeline
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
            self._progress_at = time.monotonic()
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        self._inflight.append((plan.step, sampled, plan))
        self.plans.send(self._out.encode(plan))

    def send_import(self, msg: KvImport) -> None:
        """A KV copy for every rank, ordered before the plans sent after it."""
        self.plans.send(self._out.encode(msg))

    def collect_imports(self) -> list[KvImported]:
        out, self._imported = self._imported, []
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
        now = time.monotonic()
        if self.failure is None and now - self._peers_checked_at >= PEER_CHECK_S:
            self._check_peers()
        if self.failure is None and self._inflight:
            stalled = now - self._progress_at
            if stalled > self.config.scheduler.step_timeout:
                self.failure = (
                    f"step {self._inflight[0][0]} made no progress for {stalled:.1f} s "
                    f"(--step-timeout {self.config.scheduler.step_timeout:g}): a worker is hung"
                )

    def _check_peers(self) -> None:
        """A failure if any known worker process has died."""
        self._peers_checked_at = time.monotonic()
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
            if self.started or not 0 <= msg.rank < tp or msg.num_blocks < 1 or msg.vocab_size < 1:
                self.refusals.refuse(
                    "bad WorkerReady", f"rank {msg.rank} (started: {self.started})"
                )
                return
            self.workers[msg.rank] = msg
        elif isinstance(msg, KvImported):
            if not 0 <= msg.rank < self.config.parallel.tensor_parallel_size:
                self.refusals.refuse("bad KvImported", f"rank {msg.rank}")
                return
            self._imported.append(msg)
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
        problem = _check_result(msg, tokens, sampled, self.vocab_size, plan)
        if problem is not None:
            self.refusals.refuse("malformed result", f"step {msg.step}: {problem}")
            return
        self._inflight.popleft()
        self._progress_at = time.monotonic()
        self.worker_rejected = msg.rejected_total
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


def _check_result(
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
    if msg.failed:
        known = {s.seq_id for s in plan.seqs} | {s.seq_id for s in plan.new_seqs}
        if not known.issuperset(msg.failed):
            return "failed sequences the plan did not touch"
    return None


def _subsequence(got: list[int], want: list[int]) -> bool:
    """`got` is `want` less some entries (a worker skips the sequences of a failed step)."""
    it = iter(want)
    return all(any(x == y for y in it) for x in got)
