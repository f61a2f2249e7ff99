"""Running the engine requests of one HTTP request: text events per choice, merged.

Each choice (n per prompt) is its own engine request, detokenized on its own.
`merge_choices` runs them as tasks and yields their events in arrival order;
a client disconnect cancels every task at once, which aborts their engine
requests (see `EngineClient.generate`), even when nobody reads the stream any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from subway.frontend.detokenizer import Detokenizer
from subway.frontend.engine_client import EngineClient, EngineDeadError
from subway.frontend.metrics import Metrics
from subway.ipc.messages import RequestDelta, SamplingParams


class ClientDisconnected(Exception):
    pass


class GenerationError(RuntimeError):
    """The engine finished a request with finish_reason "error"."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ChoiceSpec:
    index: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    skip_special_tokens: bool = True
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"


@dataclass
class ChoiceEvent:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


def _logprobs(delta: RequestDelta, n: int) -> list[TokenLogprob] | None:
    if delta.logprobs is None:
        return None
    out = []
    for i in range(n):
        top_ids = delta.top_ids[i] if delta.top_ids else []
        top_lps = delta.top_logprobs[i] if delta.top_logprobs else []
        out.append(
            TokenLogprob(
                delta.token_ids[i], delta.logprobs[i], list(zip(top_ids, top_lps, strict=False))
            )
        )
    return out


async def run_choice(
    engine: EngineClient, tokenizer, spec: ChoiceSpec, metrics: Metrics | None = None
) -> AsyncIterator[ChoiceEvent]:
    """One choice's events; the last one has a finish_reason. Stops early on a stop string.

    With `metrics`, a request that finishes (not one cut by a disconnect) is observed.
    """
    arrival = time.time()
    token_times: list[float] = []
    detok = Detokenizer(tokenizer, spec.prompt_ids, spec.stops, spec.skip_special_tokens)
    stream = engine.generate(
        spec.request_id,
        spec.prompt_ids,
        spec.sampling,
        priority=spec.priority,
        slo_ttft_ms=spec.slo_ttft_ms,
        slo_class=spec.slo_class,
    )
    async with contextlib.aclosing(stream) as deltas:
        async for delta in deltas:
            if delta.finish_reason == "error":
                raise GenerationError(f"the engine failed request {spec.request_id}")
            step = detok.add(delta.token_ids)
            event = ChoiceEvent(
                spec.index,
                step.text,
                list(delta.token_ids[: step.num_tokens]),
                _logprobs(delta, step.num_tokens),
            )
            token_times += [time.time()] * step.num_tokens
            if step.stopped:
                event.finish_reason = "stop"
            elif delta.finish_reason is not None:
                last = detok.finish()
                event.text += last.text
                event.finish_reason = "stop" if last.stopped else delta.finish_reason
            if event.finish_reason is not None and metrics is not None:
                metrics.observe_request(
                    len(spec.prompt_ids), token_times, arrival, time.time(), event.finish_reason
                )
            yield event
            if event.finish_reason is not None:
                return  # leaving the `async with` aborts the engine request if it still runs
    raise EngineDeadError(f"request {spec.request_id} ended without a finish reason")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


_DONE = object()
_DISCONNECTED = object()


async def merge_choices(
    choices: list[Callable[[], AsyncIterator[ChoiceEvent]]], request: Request | None
) -> AsyncIterator[ChoiceEvent]:
    """Events of all choices as they come. Raises ClientDisconnected, EngineDeadError, GenerationError."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(make: Callable[[], AsyncIterator[ChoiceEvent]]) -> None:
        try:
            async with contextlib.aclosing(make()) as events:
                async for event in events:
                    queue.put_nowait(event)
            queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(make)) for make in choices]

    async def watch() -> None:
        await _wait_disconnect(request)
        for t in tasks:
            t.cancel()
        queue.put_nowait(_DISCONNECTED)

    watcher = asyncio.create_task(watch()) if request is not None else None
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif item is _DISCONNECTED:
                raise ClientDisconnected()
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        if watcher is not None:
            watcher.cancel()
