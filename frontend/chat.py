"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from subway.frontend.generation import ChoiceGroup, ChoiceSpec, ClientDisconnected
from subway.frontend.inputs import (
    chat_prompt,
    choice_sampling,
    resolve_max_tokens,
    sampling_params,
)
from subway.frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
)
from subway.frontend.serving import (
    SSE_DONE,
    ServingContext,
    access_record,
    chat_logprobs,
    check_model,
    engine_failure,
    new_id,
    parse,
    sse,
)


def _specs(req: ChatCompletionRequest, ctx: ServingContext, request_id: str):
    limits = ctx.limits()
    prompt = chat_prompt(req, ctx.tokenizer, limits)
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt.ids), limits, None)
    top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_params(req, max_tokens, top, limits)
    specs = [
        ChoiceSpec(
            index=i,
            request_id=f"{request_id}-{i}",
            prompt_ids=prompt.ids,
            sampling=choice_sampling(sampling, i),
            stops=req.stop_strings(),
            skip_special_tokens=req.skip_special_tokens,
            priority=req.priority,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_class=req.slo_class,
        )
        for i in range(req.n)
    ]
    return prompt, specs


async def create_chat_completion(request: Request, ctx: ServingContext) -> Response:
    req = parse(ChatCompletionRequest, await request.body())
    check_model(req, ctx.config)
    request_id = new_id("chatcmpl")
    prompt, specs = _specs(req, ctx, request_id)
    record = access_record(request, request_id, len(prompt.ids))
    try:
        group = ChoiceGroup(
            ctx.engine,
            ctx.tokenizer,
            specs,
            request=request,
            metrics=ctx.metrics,
            timeout=ctx.timeout(req.timeout),
            record=record,
        )
    except Exception as e:
        raise engine_failure(e) from e
    model = ctx.config.model.served_model_name
    if req.stream:
        body = _stream(ctx, req, request_id, model, group, len(prompt.ids))
        return StreamingResponse(body, media_type="text/event-stream")

    texts = [""] * req.n
    counts = [0] * req.n
    finish: list[str | None] = [None] * req.n
    lps = [ChatLogprobs(content=[]) if req.logprobs else None for _ in specs]
    try:
        async for ev in group.events():
            lp = lps[ev.index]
            if ev.logprobs is not None and lp is not None and lp.content is not None:
                lp.content += chat_logprobs(ctx, ev.logprobs).content or []
            texts[ev.index] += ev.text
            counts[ev.index] += len(ev.token_ids)
            finish[ev.index] = ev.finish_reason or finish[ev.index]
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    prompt_tokens, completion_tokens = len(prompt.ids), sum(counts)
    response = ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=[
            ChatChoice(
                index=i,
                message=AssistantMessage(content=texts[i]),
                logprobs=lps[i],
                finish_reason=finish[i],
            )
            for i in range(req.n)
        ],
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
    )
    return JSONResponse(response.model_dump())


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    model: str,
    group: ChoiceGroup,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    completion_tokens = 0
    try:
        for i in range(req.n):
            delta = DeltaMessage(role="assistant", content="")
            yield chunk([ChatChunkChoice(index=i, delta=delta)])
        async for ev in group.events():
            completion_tokens += len(ev.token_ids)
            if not (ev.text or ev.finish_reason or ev.logprobs):
                continue
            lp = chat_logprobs(ctx, ev.logprobs) if ev.logprobs and req.logprobs else None
            delta = DeltaMessage(content=ev.text or None)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=ev.index, delta=delta, logprobs=lp, finish_reason=ev.finish_reason
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
        group.close()
    if req.include_usage:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        yield chunk([], usage)
    yield SSE_DONE
