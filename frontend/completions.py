"""POST /v1/completions.

With `echo`, each choice's text starts with its prompt; with `echo` and
`logprobs`, its logprobs start with the prompt's tokens (the first one's
logprob null), as evaluation harnesses read them to score answers. `max_tokens`
0 is allowed with `echo`: the prompt alone (the engine still runs the prefill
when logprobs are asked, and its one generated token is dropped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from subway.frontend.errors import APIError
from subway.frontend.generation import (
    ChoiceEvent,
    ChoiceGroup,
    ChoiceSpec,
    ClientDisconnected,
)
from subway.frontend.inputs import (
    Prompt,
    choice_sampling,
    completion_prompts,
    resolve_max_tokens,
    sampling_params,
)
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
    access_record,
    check_model,
    completion_logprobs,
    engine_failure,
    new_id,
    parse,
    sse,
)

DEFAULT_MAX_TOKENS = 16


class CompletionChoices:
    """Per choice: what the engine request is, and what the response shows of it."""

    def __init__(self, req: CompletionRequest, ctx: ServingContext, request_id: str) -> None:
        limits = ctx.limits()
        self.prompts = completion_prompts(req, ctx.tokenizer, limits)
        self.no_output = req.max_tokens == 0  # echo only
        want_prompt_lps = req.echo and req.logprobs is not None
        self.specs: list[ChoiceSpec] = []
        self.prompt_of: list[Prompt] = []
        for p_index, prompt in enumerate(self.prompts):
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(prompt.ids), limits, DEFAULT_MAX_TOKENS
            )
            sampling = sampling_params(
                req,
                max(1, max_tokens),
                req.logprobs,
                limits,
                prompt_logprobs=req.logprobs if want_prompt_lps else None,
            )
            for j in range(req.n):
                index = p_index * req.n + j
                self.prompt_of.append(prompt)
                self.specs.append(
                    ChoiceSpec(
                        index=index,
                        request_id=f"{request_id}-{index}",
                        prompt_ids=prompt.ids,
                        sampling=choice_sampling(sampling, j),
                        stops=req.stop_strings(),
                        skip_special_tokens=req.skip_special_tokens,
                        priority=req.priority,
                        slo_ttft_ms=req.slo_ttft_ms,
                        slo_class=req.slo_class,
                    )
                )
        self.prompt_tokens = sum(len(p.ids) for p in self.prompts)
        # With max_tokens 0 and no logprobs, there is nothing to ask the engine.
        self.run_engine = not self.no_output or want_prompt_lps

    def echo(self, ctx: ServingContext, req: CompletionRequest, index: int) -> str:
        if not req.echo:
            return ""
        prompt = self.prompt_of[index]
        return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.ids)


def _shown(choices: CompletionChoices, ev: ChoiceEvent) -> ChoiceEvent:
    """With max_tokens 0 the generated token is dropped: the choice ends at its prompt."""
    if not choices.no_output:
        return ev
    return ChoiceEvent(
        ev.index,
        finish_reason="length" if ev.finish_reason is not None else None,
        prompt_logprobs=ev.prompt_logprobs,
    )


async def create_completion(request: Request, ctx: ServingContext) -> Response:
    req = parse(CompletionRequest, await request.body())
    check_model(req, ctx.config)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    request_id = new_id("cmpl")
    choices = CompletionChoices(req, ctx, request_id)
    record = access_record(request, request_id, choices.prompt_tokens)
    echoes = [choices.echo(ctx, req, s.index) for s in choices.specs]
    model = ctx.config.model.served_model_name
    group = None
    if choices.run_engine:
        try:
            group = ChoiceGroup(
                ctx.engine,
                ctx.tokenizer,
                choices.specs,
                request=request,
                metrics=ctx.metrics,
                timeout=ctx.timeout(req.timeout),
                record=record,
            )
        except Exception as e:
            raise engine_failure(e) from e
    if req.stream:
        body = _stream(ctx, req, request_id, model, group, choices, echoes)
        return StreamingResponse(body, media_type="text/event-stream")

    n = len(choices.specs)
    texts = list(echoes)
    counts = [0] * n
    finish: list[str | None] = ["length" if group is None else None] * n
    lps = [CompletionLogprobs() if req.logprobs is not None else None for _ in range(n)]
    if group is not None:
        try:
            async for raw in group.events():
                ev = _shown(choices, raw)
                lp = lps[ev.index]
                if lp is not None and ev.prompt_logprobs is not None:
                    _extend(lp, completion_logprobs(ctx, ev.prompt_logprobs, 0))
                if lp is not None and ev.logprobs is not None:
                    _extend(lp, completion_logprobs(ctx, ev.logprobs, len(texts[ev.index])))
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
            for i in range(n)
        ],
        usage=Usage(
            prompt_tokens=choices.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=choices.prompt_tokens + completion_tokens,
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
    group: ChoiceGroup | None,
    choices: CompletionChoices,
    echoes: list[str],
) -> AsyncIterator[str]:
    def chunk(items: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionChunk(id=request_id, model=model, choices=items, usage=usage))

    offsets = [0] * len(echoes)
    completion_tokens = 0
    # The echo goes first, with the prompt's logprobs when they are asked (they come
    # with the first event), so the first chunk of a choice waits for that event then.
    pending_echo = [bool(e) for e in echoes]
    want_prompt_lps = req.echo and req.logprobs is not None
    try:
        if group is None:  # max_tokens 0, no logprobs: the echoes and we are done
            for i, echo in enumerate(echoes):
                yield chunk([CompletionChoice(index=i, text=echo, finish_reason="length")])
        else:
            if not want_prompt_lps:
                for i, echo in enumerate(echoes):
                    if echo:
                        yield chunk([CompletionChoice(index=i, text=echo)])
                        offsets[i] = len(echo)
                        pending_echo[i] = False
            async for raw in group.events():
                ev = _shown(choices, raw)
                completion_tokens += len(ev.token_ids)
                i = ev.index
                lp = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs()
                    if ev.prompt_logprobs is not None and want_prompt_lps:
                        _extend(lp, completion_logprobs(ctx, ev.prompt_logprobs, 0))
                    if ev.logprobs is not None:
                        _extend(lp, completion_logprobs(ctx, ev.logprobs, offsets[i] + len(
                            echoes[i] if pending_echo[i] else ""
                        )))  # fmt: skip
                text = ev.text
                if pending_echo[i]:
                    text = echoes[i] + text
                    pending_echo[i] = False
                if not (text or ev.finish_reason or (lp is not None and lp.tokens)):
                    continue
                offsets[i] += len(text)
                yield chunk(
                    [
                        CompletionChoice(
                            index=i, text=text, logprobs=lp, finish_reason=ev.finish_reason
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
        if group is not None:
            group.close()
    if req.include_usage:
        yield chunk(
            [],
            Usage(
                prompt_tokens=choices.prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=choices.prompt_tokens + completion_tokens,
            ),
        )
    yield SSE_DONE
