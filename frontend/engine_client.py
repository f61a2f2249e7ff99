"""The frontend's engine client: requests out to the scheduler, each one's deltas back.

Three parts, one per concern:

- `SchedulerLink` (`scheduler_link.py`): the sockets, and the engine's health;
- the prompt ring (`prompt_ring.py`), a buffer of its own per frontend
  process. A run of an aborted request is freed only when a later delta for
  it arrives (the scheduler sends its "abort" delta once no plan that can read
  the run is still in flight), or when a new scheduler greets us;
- `RequestStream`: the deltas of one request. Its holder closes it; it tells
  whoever made it through the `on_close` callback it was given. Deltas that
  arrive while an earlier one is still unread are merged into it (`_absorb`,
  as vLLM's output collector merges outputs): a reader that falls behind holds
  one delta of the tokens it has not read, never a queue that grows per step.
  What all streams hold unread is bounded too (`--max-unread-tokens`): past
  it, the stream furthest behind is cut: its unread tokens are dropped, its
  request aborted, and its reader's next delta ends it with finish_reason
  "abort" (what it read before is the output's prefix). vLLM merges outputs
  the same way and keeps them however many there are;

`EngineClient` puts them together: one per frontend process, used from its
event loop only. Sends use NOBLOCK and never await, so that an abort can be
sent from a `finally` block of a cancelled task; `submit` is synchronous for
the same reason, and so that admission (the `max_waiting` bound) is decided
before a response starts: a request either is in the scheduler's hands or raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from subway.frontend.prompt_ring import PromptRing
from subway.frontend.scheduler_link import EngineDeadError, SchedulerLink
from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AbortRequest,
    AddLora,
    AddRequest,
    KvLease,
    LoraAdapter,
    RemoveLora,
    RequestDelta,
    SamplingParams,
)

log = logging.getLogger("subway.frontend")


class QueueFullError(RuntimeError):
    """More sequences would wait than `max_waiting`, or prompt tokens than `max_queued_tokens`."""


class RequestStream:
    """The deltas of one submitted request, up to the one with a finish_reason.

    Iterate it with `async for`; `close()` (idempotent) ends it and calls
    `on_close(stream)`, whose owner aborts the request if it had not finished.
    Raises EngineDeadError when the engine fails. A delta put while the last one
    put is unread joins it (`_absorb`), so what waits is one delta per stream
    (the tokens not read yet), however far its reader is behind. `unread` counts
    them (a token with k top logprobs as 1 + k); `on_unread(change)`, if given,
    hears each change of it.
    """

    def __init__(
        self,
        request_id: str,
        submitted_at: float,
        on_close: Callable[[RequestStream], None],
        on_unread: Callable[[int], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.submitted_at = submitted_at
        self.finished = False
        self.closed = False
        self.cut = False  # `cut_off`: what the engine sends for it from now on is dropped
        self.unread = 0
        self._on_close = on_close
        self._on_unread = on_unread
        self._items: deque[RequestDelta | BaseException] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestDelta | BaseException) -> None:
        if self.cut:
            return
        items = self._items
        if isinstance(item, RequestDelta):
            weight = _weight(item)
            if weight:  # (inline: once per delta of every request)
                self.unread += weight
                if self._on_unread is not None:
                    self._on_unread(weight)
            if items and _absorb(items[-1], item):
                return
        items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cut_off(self) -> None:
        """Drop what is unread; the reader's next delta ends the stream with "abort"."""
        if self.finished or self.closed:
            return
        self._items.clear()
        self._count(-self.unread)
        self.put(RequestDelta(request_id=self.request_id, token_ids=[], finish_reason="abort"))
        self.cut = True

    @property
    def num_pending(self) -> int:
        """Items put and not read yet (a merged delta counts once)."""
        return len(self._items)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.close()
            raise item
        weight = _weight(item)
        if weight:
            self.unread -= weight
            if self._on_unread is not None:
                self._on_unread(-weight)
        if item.finish_reason is not None:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._count(-self.unread)
            self._items.clear()
            self._on_close(self)

    def _count(self, change: int) -> None:
        if change:
            self.unread += change
            if self._on_unread is not None:
                self._on_unread(change)


def _weight(delta: RequestDelta) -> int:
    """What a delta counts against `--max-unread-tokens`: its tokens, each 1 + its top
    logprobs (the numbers it holds)."""
    top = delta.top_ids
    return len(delta.token_ids) * (1 + len(top[0])) if top else len(delta.token_ids)


def _absorb(last: RequestDelta | BaseException, new: RequestDelta) -> bool:
    """Merge `new` into `last`, an unread delta of the same request, in place, when nothing
    is lost by it: `last` has not finished, both carry logprobs or neither does, and `new`
    has nothing that only a first delta carries. Amortised O(len(new))."""
    if (
        not isinstance(last, RequestDelta)
        or last.finish_reason is not None
        or (last.logprobs is None) != (new.logprobs is None)
        or (last.top_ids is None) != (new.top_ids is None)
        or (last.top_logprobs is None) != (new.top_logprobs is None)
        or new.prompt_logprobs is not None
        or new.queue_time is not None
    ):
        return False
    last.token_ids += new.token_ids
    if new.logprobs is not None:
        last.logprobs += new.logprobs  # type: ignore[operator]
    if new.top_ids is not None:
        last.top_ids += new.top_ids  # type: ignore[operator]
    if new.top_logprobs is not None:
        last.top_logprobs += new.top_logprobs  # type: ignore[operator]
    last.finish_reason = new.finish_reason
    last.num_prompt_tokens = last.num_prompt_tokens or new.num_prompt_tokens
    last.num_cached_tokens = last.num_cached_tokens or new.num_cached_tokens
    if new.kv_lease is not None:
        last.kv_lease = new.kv_lease
    return True


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        heartbeat_timeout: float = 3.0,
        fail_after: float = 30.0,
    ) -> None:
        """`heartbeat_timeout`: silence after which the link is not `healthy`;
        `fail_after`: silence after which in-flight requests fail."""
        self.config = config
        self.draining = False  # set on SIGTERM: no new requests; in-flight ones finish
        self.link = SchedulerLink(
            config, self._route, self._fail_all, heartbeat_timeout, fail_after
        )
        self.link.on_new_scheduler = self._on_new_scheduler
        self.ring = PromptRing()  # its shared memory is created by `start`
        self._aborted: set[str] = set()  # aborted, their prompt runs held until a delta
        self._streams: dict[str, RequestStream] = {}
        self._unstarted: dict[str, int] = {}  # no delta yet (waiting, prefilling): prompt len
        self._queued_tokens = 0  # their sum
        self.num_unread = 0  # what the streams hold unread (`RequestStream.unread`), in all
        self._cutting = False
        # LoRA changes made at runtime, told again to a scheduler that (re)starts: adapters
        # loaded and still served, and `--lora-modules` ones unloaded (`send_lora`).
        self._loras_added: dict[int, LoraAdapter] = {}
        self._loras_removed: set[int] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def in_flight(self, request_id: str) -> bool:
        """Whether a request of this id is in flight here."""
        return request_id in self._streams

    @property
    def num_waiting(self) -> int:
        return self.waiting_with(0)

    def waiting_with(self, n: int) -> int:
        """Sequences (engine requests) that would wait for a place in the batch with `n`
        more, as far as this frontend can tell.

        Requests without a token yet, less the batch places (`max_num_seqs`) that
        requests with tokens leave free: a burst that the scheduler admits at once
        does not count as waiting. When the scheduler reports a queue of its own
        (preemptions, a batch limited by KV blocks), that queue plus `n` if larger.
        That queue is `num_queued`, the requests a plan passed over, not `num_waiting`:
        requests that arrived while a plan was in flight wait there for the next one,
        free seats or not, and counting them refused a request that would have run.
        """
        started = len(self._streams) - len(self._unstarted)
        free = max(0, self.config.scheduler.max_num_seqs - started)
        local = max(0, len(self._unstarted) + n - free)
        reported = self.link.stats.num_queued if self.link.stats is not None else 0
        return max(local, reported + n if reported else 0)

    def check_capacity(self, n: int, tokens: int = 0) -> None:
        """Raise QueueFullError if `n` more sequences of `tokens` prompt tokens in all would
        pass `max_waiting` sequences waiting or `max_queued_tokens` queued (0: no bound)."""
        limit, token_limit = self.config.server.max_waiting, self.config.server.max_queued_tokens
        if limit > 0 and self.waiting_with(n) > limit:
            raise QueueFullError(f"{self.num_waiting} sequences wait; {n} more pass {limit}")
        if token_limit > 0 and self._queued_tokens + tokens > token_limit:
            raise QueueFullError(
                f"{self._queued_tokens} prompt tokens are queued; {tokens} more pass {token_limit}"
            )

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.link.is_open:
            return
        self.ring = PromptRing.create(self.config.ipc)
        self.link.prompt_shm = self.ring.name
        self.link.start()

    async def aclose(self) -> None:
        await self.link.stop_tasks()
        self.close()

    def close(self) -> None:
        """Fail what is in flight, close the sockets, unlink the shm. Idempotent."""
        self._fail_all(EngineDeadError("the frontend is shutting down"))
        self.link.close()
        self.ring.close()

    # ------------------------------------------------------------ requests

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_class: str = "interactive",
        handoff: bool = False,
        kv_source: KvLease | None = None,
        lora: int = 0,
    ) -> RequestStream:
        """Send one request to the scheduler now; its deltas come through the returned stream.

        Raises EngineDeadError if the engine cannot serve. Whoever holds the
        stream must close it (it aborts the request if unfinished).
        """
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if not self.link.ready or not self.link.is_open:
            raise EngineDeadError(self.link.error or "the engine is not ready")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        submitted_at = time.time()
        try:
            self.link.send(
                AddRequest(
                    request_id=request_id,
                    prompt=self.ring.ref(request_id, prompt_ids),
                    prompt_len=len(prompt_ids),
                    sampling=sampling,
                    arrival_time=submitted_at,
                    priority=priority,
                    slo_ttft_ms=slo_ttft_ms,
                    slo_class=slo_class,
                    handoff=handoff,
                    kv_source=kv_source,
                    lora=lora,
                )
            )
        except BaseException:
            self.ring.release(request_id)
            raise
        stream = RequestStream(request_id, submitted_at, self._stream_closed, self._count_unread)
        self._streams[request_id] = stream
        self._unstarted[request_id] = len(prompt_ids)
        self._queued_tokens += len(prompt_ids)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        **options,
    ) -> AsyncIterator[RequestDelta]:
        """`submit` (same `options`) as an async generator: leaving it early (close, cancel,
        exception in the consumer) aborts the request; use `contextlib.aclosing` so that this
        happens at once."""
        stream = self.submit(request_id, prompt_ids, sampling, **options)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def send_lora(self, msg: AddLora | RemoveLora) -> None:
        """Tell the scheduler that an adapter is served from now on, or no longer (its
        requests in flight finish first). Remembered: a scheduler that starts again after
        this is told again (`_on_new_scheduler`). A scheduler out of reach is not an error:
        it is told when it greets us."""
        if isinstance(msg, AddLora):
            self._loras_added[msg.adapter.lora_id] = msg.adapter
        elif self._loras_added.pop(msg.lora_id, None) is None:
            self._loras_removed.add(msg.lora_id)  # a --lora-modules one: the config has it
        with contextlib.suppress(EngineDeadError):
            self.link.send(msg)

    def abort_all(self) -> int:
        """Abort every request in flight: the scheduler drops them, and each stream ends
        at once with finish_reason "abort" (at shutdown, when the drain has timed out)."""
        live = list(self._streams.values())
        for stream in live:
            self._send_abort(stream.request_id)
            stream.put(
                RequestDelta(request_id=stream.request_id, token_ids=[], finish_reason="abort")
            )
        return len(live)

    # ------------------------------------------------------------ callbacks

    def _stream_closed(self, stream: RequestStream) -> None:
        """A stream ended: forget it; abort the request in the scheduler if unfinished."""
        request_id = stream.request_id
        self._streams.pop(request_id, None)
        self._queued_tokens -= self._unstarted.pop(request_id, 0)
        if stream.finished:
            self.ring.release(request_id)
        else:
            self._send_abort(request_id)
            if request_id in self.ring.runs:
                self._aborted.add(request_id)

    def _count_unread(self, change: int) -> None:
        """A stream's unread tokens changed; past `--max-unread-tokens` in all, the streams
        furthest behind are cut (`RequestStream.cut_off`) and their requests aborted."""
        self.num_unread += change
        limit = self.config.server.max_unread_tokens
        if change <= 0 or limit <= 0 or self.num_unread <= limit or self._cutting:
            return
        self._cutting = True
        try:
            while self.num_unread > limit:
                behind = max(self._streams.values(), key=lambda st: st.unread, default=None)
                if behind is None or behind.unread == 0:
                    break
                log.warning(
                    "request %s is aborted: its reader has not read %d of its tokens "
                    "(weighed with their logprobs), the most of all streams, which pass "
                    "--max-unread-tokens %d",
                    behind.request_id, behind.unread, limit,
                )  # fmt: skip
                behind.cut_off()
                self._send_abort(behind.request_id)
        finally:
            self._cutting = False

    def _send_abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # a closed link: nothing left to abort
            self.link.send(AbortRequest(request_id=request_id))

    def _route(self, deltas: list[RequestDelta]) -> None:
        """The link's deltas, each to its request's stream (and its prompt's run freed)."""
        aborted = self._aborted
        for delta in deltas:
            self.ring.release(delta.request_id)
            if aborted:
                aborted.discard(delta.request_id)
            self._queued_tokens -= self._unstarted.pop(delta.request_id, 0)
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put(delta)

    def _on_new_scheduler(self) -> None:
        """A new scheduler: the old one, which could still have read the aborted requests'
        prompts, is gone; the new one knows only the config's adapters."""
        for request_id in self._aborted:
            self.ring.release(request_id)
        self._aborted.clear()
        with contextlib.suppress(EngineDeadError):
            for lora_id in sorted(self._loras_removed):
                self.link.send(RemoveLora(lora_id))
            for adapter in self._loras_added.values():
                self.link.send(AddLora(adapter))

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put(error)
