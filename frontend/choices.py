"""Choice fan-out: the engine requests of one API request, run and merged into text events.

Each choice (n per prompt) is its own engine request, detokenized on its own:
`fan_out` makes their specs, choice j of prompt p at index p * n + j, and a
seeded request's choices draw from seeds seed, seed + 1, ... (as vLLM), so
that they differ from each other but are reproducible.

A `ChoiceGroup` submits them all at once, synchronously, so that a full queue
or a dead engine is an error response before any response starts; then it runs
one task per choice (`run_choice`) and yields their events in arrival order. A
client disconnect cancels every task at once, which aborts their engine
requests, even when nobody reads the stream any more. A deadline (the
request's timeout) ends every unfinished choice with finish_reason "abort".

What a choice asks the frontend to render is bounded before it is submitted
(`check_output_bounds`): top logprobs per token at most `--max-logprobs`, prompt
positions with logprobs at most `--max-prompt-logprobs-tokens`; past them, 400.

Metrics are observed as tokens arrive (time to first token, inter-token
latency) and when a choice ends, however it ends (end-to-end latency, finish
reason). Logprobs leave here as `TokenLogprob`s: token ids and numbers, which
`logprobs.py` renders in each API's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from subway.frontend.detokenizer import Detokenizer
from subway.frontend.engine import Engine
from subway.frontend.engine_client import EngineDeadError, RequestStream
from subway.frontend.errors import APIError
from subway.frontend.inputs import Job, runs_per_prompt
from subway.frontend.logprobs import TokenLogprob, prompt_token_logprobs, token_logprobs
from subway.frontend.metrics import Metrics
from subway.frontend.protocol import SamplingRequest
from subway.ipc.config import EngineConfig
from subway.ipc.messages import PromptLogprobs, RequestDelta, SamplingParams


class ClientDisconnected(Exception):
    """The HTTP client went away while its choices ran."""


class GenerationError(RuntimeError):
    """The engine finished a request with finish_reason "error"."""


@dataclass
class ChoiceSpec:
    index: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"
    logprobs_param: str = "logprobs"  # the request's field that asks top logprobs
    lora: int = 0  # its LoRA adapter's id (`Job.lora`); 0: the base model


@dataclass
class ChoiceEvent:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # tokens this event accounts for
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event, when asked
    embedding: bytes | None = None  # on the first event, when pooled (float32)


def fan_out(req: SamplingRequest, request_id: str, job: Job) -> list[ChoiceSpec]:
    """`runs_per_prompt(req)` choices per prompt of `job` (`n`, or a completion's `best_of`),
    each its own engine request `{request_id}-{index}`."""
    specs = []
    for prompt, sampling in zip(job.prompts, job.sampling, strict=True):
        for j in range(runs_per_prompt(req)):
            index = len(specs)
            specs.append(
                ChoiceSpec(
                    index=index,
                    request_id=f"{request_id}-{index}",
                    prompt_ids=prompt.ids,
                    sampling=_choice_sampling(sampling, j),
                    stops=req.stop_strings(),
                    skip_special_tokens=req.skip_special_tokens,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    priority=req.priority,
                    slo_ttft_ms=req.slo_ttft_ms,
                    slo_class=req.slo_class,
                    logprobs_param="top_logprobs" if hasattr(req, "top_logprobs") else "logprobs",
                    lora=job.lora,
                )
            )
    return specs


def check_output_bounds(specs: list[ChoiceSpec], config: EngineConfig) -> None:
    """400 for a choice that asks more top logprobs per token than `--max-logprobs`, or
    logprobs of more prompt tokens than `--max-prompt-logprobs-tokens` (each rendered
    entry is a decode and a JSON object: a request may not multiply them at will)."""
    server = config.server
    for s in specs:
        top = max(s.sampling.logprobs or 0, s.sampling.prompt_logprobs or 0)
        if top > server.max_logprobs:
            raise APIError(
                400,
                f"{s.logprobs_param}={top} is more than this server's limit of "
                f"{server.max_logprobs} (--max-logprobs)",
                s.logprobs_param,
            )
        positions, limit = len(s.prompt_ids), server.max_prompt_logprobs_tokens
        if s.sampling.prompt_logprobs is not None and 0 < limit < positions:
            raise APIError(
                400,
                f"the prompt has {positions} tokens; this server returns the logprobs of at "
                f"most {limit} prompt tokens (--max-prompt-logprobs-tokens)",
                "echo",
            )


def _choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    if sampling.seed is None or j == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + j)


async def run_choice(
    stream: RequestStream,
    tokenizer,
    spec: ChoiceSpec,
    metrics: Metrics | None = None,
    deadline: float | None = None,
    step_time: Callable[[], float] | None = None,
) -> AsyncIterator[ChoiceEvent]:
    """One choice's events; the last one has a finish_reason. Stops early on a stop string.

    `deadline` (loop time): past it, the choice ends with finish_reason "abort".
    The caller closes `stream` (which aborts the engine request if it still runs).
    """
    detok = Detokenizer(
        tokenizer,
        spec.prompt_ids,
        spec.stops,
        spec.skip_special_tokens,
        include_stop=spec.include_stop_str_in_output,
        min_tokens=spec.sampling.min_tokens,
    )
    timing = ChoiceTiming(metrics, stream.submitted_at, len(spec.prompt_ids), step_time)
    first = True
    try:
        while True:
            try:
                delta = await _next_delta(stream, spec, deadline)
            except TimeoutError:
                last = detok.finish()
                timing.finish("abort")
                yield ChoiceEvent(spec.index, last.text, finish_reason="abort")
                return
            event, stopped = _delta_event(delta, detok, spec, first)
            first = False
            timing.observe_tokens(len(event.token_ids), delta)
            _set_finish_reason(event, delta, detok, stopped)
            if event.finish_reason is not None:
                timing.finish(event.finish_reason)
            yield event
            if event.finish_reason is not None:
                return
    finally:
        timing.finish(
            "abort"
        )  # a no-op if the choice finished; else it was cut (disconnect, error)


class ChoiceTiming:
    """One choice's metrics: time to first token and inter-token latency as tokens arrive,
    end-to-end latency and finish reason once, when it ends (however it ends)."""

    def __init__(
        self,
        metrics: Metrics | None,
        arrival: float,
        prompt_len: int,
        step_time: Callable[[], float] | None = None,
    ) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.step_time = step_time
        self.last_token_at: float | None = None
        self.ttft: float | None = None
        self.num_tokens = 0
        self.finished = False

    def observe_tokens(self, n: int, delta: RequestDelta) -> None:
        self.num_tokens += n
        if self.metrics is None or n == 0:
            return
        now = time.time()
        for _ in range(n):
            if self.last_token_at is None:
                queue_time = delta.queue_time
                if queue_time is None:  # the scheduler did not say: the first step's time out
                    step = self.step_time() if self.step_time else 0.0
                    queue_time = (now - self.arrival) - step
                self.ttft = now - self.arrival
                self.metrics.observe_first_token(self.ttft, queue_time)
            else:
                self.metrics.observe_inter_token(now - self.last_token_at)
            self.last_token_at = now

    def finish(self, reason: str) -> None:
        """Observes the end once; later calls do nothing."""
        if self.metrics is not None and not self.finished:
            self.finished = True
            latency = time.time() - self.arrival
            self.metrics.observe_finish(
                self.prompt_len, self.num_tokens, latency, reason, self.ttft
            )


async def _next_delta(
    stream: RequestStream, spec: ChoiceSpec, deadline: float | None
) -> RequestDelta:
    """The stream's next delta; TimeoutError past `deadline`. A stream that ends without a
    finish reason is a dead engine; a delta that finishes with "error" is the request's
    own fault (400, its grammar) or the engine's (GenerationError)."""
    try:
        if deadline is None:
            delta = await anext(stream)
        else:
            async with asyncio.timeout_at(deadline):
                delta = await anext(stream)
    except StopAsyncIteration:
        raise EngineDeadError(f"request {spec.request_id} ended without a finish reason") from None
    if delta.finish_reason == "error":
        if delta.error:  # the request's own doing (its grammar): a client error
            raise APIError(400, f"the output constraint cannot be used: {delta.error}")
        raise GenerationError(f"the engine failed request {spec.request_id}")
    return delta


def _delta_event(
    delta: RequestDelta, detok: Detokenizer, spec: ChoiceSpec, first: bool
) -> tuple[ChoiceEvent, bool]:
    """The event of one delta's tokens, up to a stop string, and whether one stopped it.
    The first event also carries the prompt's logprobs where they were asked."""
    ids = delta.token_ids
    # A token-id stop (EOS, stop_token_ids) counts as output but shows no text,
    # unless include_stop_str_in_output (as vLLM: then it is decoded as any token).
    stop_token = (
        delta.finish_reason == "stop" and len(ids) > 0 and not spec.include_stop_str_in_output
    )
    step = detok.add(ids[:-1] if stop_token else ids)
    used = step.num_tokens if step.stopped else len(ids)
    event = ChoiceEvent(spec.index, step.text, list(ids[:used]), token_logprobs(delta, used))
    if first:
        event.prompt_logprobs = _prompt_logprobs(spec, delta)
        event.embedding = delta.embedding
    return event, step.stopped


def _prompt_logprobs(spec: ChoiceSpec, delta: RequestDelta) -> list[TokenLogprob] | None:
    """The prompt's logprobs from the first delta; NaNs where they were asked but the
    engine sent none."""
    found = prompt_token_logprobs(spec.prompt_ids, delta.prompt_logprobs)
    if spec.sampling.prompt_logprobs is not None and found is None:
        nan = PromptLogprobs([math.nan] * (len(spec.prompt_ids) - 1))
        return prompt_token_logprobs(spec.prompt_ids, nan)
    return found


def _set_finish_reason(
    event: ChoiceEvent, delta: RequestDelta, detok: Detokenizer, stopped: bool
) -> None:
    """ "stop" on a stop string; at the engine's finish, the text the detokenizer held back
    joins the event, and its reason stands unless that text ends on a stop string."""
    if stopped:
        event.finish_reason = "stop"
    elif delta.finish_reason is not None:
        last = detok.finish()
        event.text += last.text
        event.finish_reason = "stop" if last.stopped else delta.finish_reason


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


_DONE = object()
_DISCONNECTED = object()
EVENTS_AHEAD = 4  # events of one choice that may wait for the reader; then the choice waits


class ChoiceGroup:
    """The engine requests of one API request: submitted on construction, events merged.

    Construction raises QueueFullError (too many waiting) or EngineDeadError
    before anything is sent for the group. `events()` raises ClientDisconnected,
    EngineDeadError or GenerationError; leaving it (or `close()`) aborts every
    unfinished engine request.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        specs: list[ChoiceSpec],
        *,
        request: Request | None = None,
        metrics: Metrics | None = None,
        timeout: float | None = None,
        on_event: Callable[[ChoiceEvent], None] | None = None,
    ) -> None:
        """`on_event` sees every event `events()` yields (the access record notes them)."""
        self.on_event = on_event
        self.max_bytes = engine.config.server.max_response_bytes  # a whole answer's, at most
        self.streams: list[RequestStream] = []
        check_output_bounds(specs, engine.config)
        engine.check_capacity(len(specs), sum(len(s.prompt_ids) for s in specs))
        try:
            for s in specs:
                self.streams.append(
                    engine.submit(
                        s.request_id,
                        s.prompt_ids,
                        s.sampling,
                        priority=s.priority,
                        slo_ttft_ms=s.slo_ttft_ms,
                        slo_class=s.slo_class,
                        lora=s.lora,
                    )
                )
        except BaseException:
            self.close()
            raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None

        def step_time() -> float:
            stats = engine.link.stats
            return stats.step_time if stats is not None else 0.0

        # Bounded: a reader that falls behind (a client that does not read its stream) stops
        # the choices' tasks, whose engine requests' deltas then merge in their streams.
        self.queue: asyncio.Queue = asyncio.Queue(EVENTS_AHEAD * len(specs))
        self.disconnected = False
        self.tasks = [
            asyncio.create_task(
                self._pump(run_choice(st, tokenizer, s, metrics, deadline, step_time))
            )
            for st, s in zip(self.streams, specs, strict=True)
        ]
        self.watcher = asyncio.create_task(self._watch(request)) if request is not None else None

    async def _pump(self, events: AsyncIterator[ChoiceEvent]) -> None:
        try:
            async with contextlib.aclosing(events) as it:
                async for event in it:
                    await self.queue.put(event)
            await self.queue.put(_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self.queue.put(e)

    async def _watch(self, request: Request) -> None:
        await _wait_disconnect(request)
        self.close()
        self.disconnected = True
        with contextlib.suppress(asyncio.QueueFull):  # full: the reader is not waiting
            self.queue.put_nowait(_DISCONNECTED)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        remaining = len(self.tasks)
        try:
            while remaining:
                if self.disconnected:
                    raise ClientDisconnected()
                item = await self.queue.get()
                if item is _DONE:
                    remaining -= 1
                elif item is _DISCONNECTED:
                    raise ClientDisconnected()
                elif isinstance(item, Exception):
                    raise item
                else:
                    if self.on_event is not None:
                        self.on_event(item)
                    yield item
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the tasks and abort every unfinished engine request. Idempotent."""
        for t in getattr(self, "tasks", []):
            t.cancel()
        watcher = getattr(self, "watcher", None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        for st in self.streams:
            st.close()
