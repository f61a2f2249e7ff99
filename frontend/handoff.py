"""One request over two engines (disaggregation): its prompt on a prefill engine, the rest
of its tokens on a decode engine, as one stream.

`HandoffStream` has `RequestStream`'s surface. It submits the request to the prefill
engine with `max_tokens` 1 and `handoff` set. That engine's last delta carries the
first token and, when it leased the prompt's blocks, a `KvLease`. If the request is not
done (a stop token, or one token was all it asked), the stream yields that token and
submits the rest to the decode engine: the prompt and the first token as its prompt,
`max_tokens` one less, the lease as its `kv_source`, so that the decode engine copies
the prompt's blocks into its prefix cache and computes only the last, partial block
(and, if the copy fails, all of it). The lease is released as soon as the decode
engine's first delta arrives (the copy, made or not, is over by then), or when the
stream closes first.

A prefill engine that fails before the first token leaves the request to a decode
engine whole: the service degrades, it does not stop. Under greedy decoding the
output is the same token for token; a sampled request's second part is seeded and
penalised as a new request whose prompt ends with the first token.

A prefill engine that hangs counts as failed, for the requests waiting on its first
token, as soon as either of its two watches says so:

- its scheduler is silent (stopped, or its loop stuck): every `HANDOFF_CHECK_S` a
  waiting request looks at the engine's link, and once it has not been `healthy`
  (no message for the link's `heartbeat_timeout`, 3 s, where the scheduler sends one
  every 0.5 s at least) for `HANDOFF_SILENT_S` more, the request goes to a decode
  engine whole: after 7-8 s of silence, not the link's `fail_after` (30 s), which
  fails the engine's requests outright. (The margin over the 3 s is for a scheduler
  that is only slow to beat, on a loaded machine: taking a request back costs its
  copy of the prompt's KV);
- its workers are hung (the scheduler alive): the scheduler's bound on a step's
  progress (`scheduler/worker_link.py`: max(10 s, 20 x the step's predicted time);
  10-11 s for CPU workers of its host that use no CPU time; about 20 s in the first
  steps of a run) ends in an EngineError, which fails the engine's requests here,
  and each is taken back the same way.

Neither is a time limit on the request: a long queue or a long prompt on a prefill
engine that is making progress is never taken back. A request taken back from an
engine that was only slow is served whole by a decode engine, with the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import msgspec

from subway.frontend.engine_client import EngineClient, RequestStream
from subway.frontend.scheduler_link import EngineDeadError
from subway.ipc.messages import KvLease, ReleaseKv, RequestDelta, SamplingParams

HANDOFF_CHECK_S = 0.5  # how often a request waiting on a prefill engine checks that it lives
HANDOFF_SILENT_S = 4.0  # how long that engine may be unhealthy before the request goes back


def can_hand_off(sampling: SamplingParams) -> bool:
    """Whether a request may be split: more than one token to make, and no state that the
    decode engine could not rebuild from the prompt (a grammar's matcher)."""
    return sampling.max_tokens > 1 and sampling.grammar is None


class HandoffStream:
    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        options: dict,
        prefill: EngineClient,
        pick_decode: Callable[[Sequence[int]], EngineClient],
    ) -> None:
        """`pick_decode(prompt)`: the decode engine for the rest (raises EngineDeadError
        when none can serve)."""
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.options = options
        self.prefill = prefill
        self.pick_decode = pick_decode
        self.finished = False
        self.closed = False
        self.lease: KvLease | None = None
        self._decoding = False
        self.inner: RequestStream = prefill.submit(
            request_id,
            prompt_ids,
            msgspec.structs.replace(sampling, max_tokens=1),
            handoff=True,
            **options,
        )
        self.submitted_at = self.inner.submitted_at
        self.handed_off = False  # the decode engine has the rest

    def __aiter__(self) -> HandoffStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            delta = await (anext(self.inner) if self._decoding else self._from_prefill())
        except EngineDeadError:
            if self._decoding:
                raise
            self._whole_to_decode()  # no first token yet: the decode engine does it all
            return await self.__anext__()
        except StopAsyncIteration:
            self.close()
            raise
        if self._decoding:
            self._release()
            if delta.finish_reason is not None:
                self.finished = True
                self.close()
            return _continuation(delta)
        if delta.finish_reason is None:
            return delta  # no such delta comes with max_tokens 1; passed on all the same
        self.lease = delta.kv_lease
        delta.kv_lease = None
        if delta.finish_reason != "length" or not delta.token_ids:
            self.finished = True  # a stop token, or an error: the request ends here
            self.close()
            return delta
        first = list(delta.token_ids)
        sp = self.sampling
        rest = msgspec.structs.replace(
            sp,
            max_tokens=sp.max_tokens - len(first),
            min_tokens=max(0, sp.min_tokens - len(first)),
            prompt_logprobs=None,
        )
        prompt = self.prompt_ids + first
        try:
            self.inner = self.pick_decode(prompt).submit(
                self.request_id, prompt, rest, kv_source=self.lease, **self.options
            )
        except BaseException:
            self.close()
            raise
        self._decoding = self.handed_off = True
        delta.finish_reason = None
        return delta

    async def _from_prefill(self) -> RequestDelta:
        """The prefill engine's next delta; EngineDeadError once that engine's link has not
        been healthy (its scheduler silent, or failed) for `HANDOFF_SILENT_S`."""
        link = self.prefill.link
        unhealthy_since: float | None = None
        while True:
            try:
                async with asyncio.timeout(HANDOFF_CHECK_S):
                    return await anext(self.inner)
            except TimeoutError:
                now = time.monotonic()
                if link.healthy:
                    unhealthy_since = None
                elif unhealthy_since is None:
                    unhealthy_since = now
                elif now - unhealthy_since >= HANDOFF_SILENT_S:
                    raise EngineDeadError("the prefill engine stopped answering") from None

    def _whole_to_decode(self) -> None:
        self.inner.close()
        self.inner = self.pick_decode(self.prompt_ids).submit(
            self.request_id, self.prompt_ids, self.sampling, **self.options
        )
        self._decoding = True

    def _release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(EngineDeadError):  # a dead engine holds nothing
                self.prefill.link.send(ReleaseKv(lease.lease_id))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inner.close()
            self._release()


def _continuation(delta: RequestDelta) -> RequestDelta:
    """A decode engine's delta as part of the whole request: its prompt was the request's
    prompt and first token, so its own prompt figures are not the request's."""
    delta.num_prompt_tokens = 0
    delta.num_cached_tokens = 0
    delta.prompt_logprobs = None
    delta.queue_time = None
    return delta
