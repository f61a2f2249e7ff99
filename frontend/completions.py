"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from subway.frontend.errors import APIError
from subway.frontend.generation import (
    ChoiceEvent,
    ChoiceSpec,
    ClientDisconnected,
    merge_choices,
    run_choice,
)
from subway.frontend.inputs import completion_prompts, resolve_max_tokens, sampling_params
from subway.frontend.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from subway.frontend.serving import (
    SSE_DONE,
    ServingContext,
    check_model,
    completion_logprobs,
    engine_failure,
    new_id,
    parse,
    sse,
)

DEFAULT_MAX_TOKENS = 16


def _specs(req: CompletionRequest, ctx: ServingContext, request_id: str):
    limits = ctx.limits()
    prompts = completion_prompts(req, ctx.tokenizer, limits)
    specs = []
    for p_index, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), limits, DEFAULT_MAX_TOKENS)
        sampling = sampling_params(req, max_tokens, req.logprobs, limits)
        for j in range(req.n):
            index = p_index * req.n + j
            specs.append(
                ChoiceSpec(
                    index=index,
                    request_id=f"{request_id}-{index}",
                    prompt_ids=prompt.ids,
                    sampling=sampling,
                    stops=req.stop_strings(),
                    skip_special_tokens=req.skip_special_tokens,
                    priority=req.priority,
                    slo_ttft_ms=req.slo_ttft_ms,
                    slo_class=req.slo_class,
                )
            )
    return prompts, specs


def _echo_text(ctx: ServingContext, req: CompletionRequest, prompt) -> str:
    if not req.echo:
        return ""
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.ids)


async def create_completion(request: Request, ctx: ServingContext) -> Response:
    req = parse(CompletionRequest, await request.body())
    check_model(req, ctx.config)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    request_id = new_id("cmpl")
    prompts, specs = _specs(req, ctx, request_id)
    echoes = [_echo_text(ctx, req, prompts[s.index // req.n]) for s in specs]
    prompt_tokens = sum(len(p.ids) for p in prompts)
    makers = [
        functools.partial(run_choice, ctx.engine, ctx.tokenizer, s, ctx.metrics) for s in specs
    ]
    model = ctx.config.served_model_name
    if req.stream:
        events = merge_choices(makers, request)
        body = _stream(ctx, req, request_id, model, events, echoes, prompt_tokens)
        return StreamingResponse(body, media_type="text/event-stream")

    texts = list(echoes)
    counts = [0] * len(specs)
    finish: list[str | None] = [None] * len(specs)
    lps = [CompletionLogprobs() if req.logprobs is not None else None for _ in specs]
    try:
        async with contextlib.aclosing(merge_choices(makers, request)) as events:
            async for ev in events:
                if ev.logprobs is not None and lps[ev.index] is not None:
                    offset = len(texts[ev.index])
                    _extend(lps[ev.index], completion_logprobs(ctx, ev.logprobs, offset))
                texts[ev.index] += ev.text
                counts[ev.index] += len(ev.token_ids)
                finish[ev.index] = ev.finish_reason or finish[ev.index]
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    completion_tokens = sum(counts)
    response = CompletionResponse(
        id=request_id,
        model=model,
        choices=[
            CompletionChoice(index=i, text=texts[i], logprobs=lps[i], finish_reason=finish[i])
            for i in range(len(specs))
        ],
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
    )
    return JSONResponse(response.model_dump())


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    model: str,
    events: AsyncGenerator[ChoiceEvent, None],
    echoes: list[str],
    prompt_tokens: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    offsets = [len(e) for e in echoes]
    completion_tokens = 0
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk([CompletionChoice(index=i, text=echo)])
        async for ev in events:
            completion_tokens += len(ev.token_ids)
            if not (ev.text or ev.finish_reason or ev.logprobs):
                continue
            lp = None
            if ev.logprobs is not None and req.logprobs is not None:
                lp = completion_logprobs(ctx, ev.logprobs, offsets[ev.index])
            offsets[ev.index] += len(ev.text)
            yield chunk(
                [
                    CompletionChoice(
                        index=ev.index, text=ev.text, logprobs=lp, finish_reason=ev.finish_reason
                    )
                ]
            )
    except ClientDisconnected:
        return
    except Exception as e:
        yield f"data: {engine_failure(e).body().model_dump_json()}\n\n"
        yield SSE_DONE
        return
    finally:
        await events.aclose()
    if req.include_usage:
        yield chunk(
            [],
            Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
    yield SSE_DONE
