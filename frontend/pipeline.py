"""The request pipeline that `/v1/completions` and `/v1/chat/completions` share, and
their routes (`add_generation_routes`).

One request goes through the same stages whichever the endpoint:

1. `inputs.py`: the body is parsed and checked, and becomes a `Job` (prompt ids
   and sampling parameters); parsing and the job (chat template, tokenization)
   run off the event loop, time-limited (`admission.Offload`);
2. `admit`: the job fans out into one engine request per choice, all submitted
   at once (`choices.py`, which reaches the scheduler through `engine_client.py`);
3. the choices' events become the API's bodies (a `View`: `ChatView`,
   `CompletionView`), answered as one JSON response (`View.whole`) or as
   server-sent events (`View.chunks`, framed by `_sse`).

An `API` names what differs between the two endpoints. Failures are mapped to
API errors here only (`engine_failure`): a refused admission is an error
response; a failure after a stream started is its last event, then
`data: [DONE]`; a client that went away gets nothing more (499 in the access log).
The native ZMQ endpoint goes through the same stages (`zmq_endpoint.py`).

A completion with `echo` starts with its prompt (and, with `logprobs`, the
prompt's logprobs, which come with the choice's first event, so the first
chunk of a choice waits for that event then); with `max_tokens` 0 it shows no
generated token (`Job.no_output`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from subway.frontend.admission import Offload, check_job_size
from subway.frontend.choices import (
    ChoiceEvent,
    ChoiceGroup,
    ClientDisconnected,
    GenerationError,
    fan_out,
)
from subway.frontend.engine_client import EngineClient, EngineDeadError, QueueFullError
from subway.frontend.errors import APIError
from subway.frontend.inputs import (
    IGNORED_HEADER,
    Job,
    Limits,
    chat_job,
    check_request,
    client_scheduling,
    completion_job,
    parse,
)
from subway.frontend.logprobs import chat_logprobs, completion_logprobs, extend
from subway.frontend.metrics import Metrics
from subway.frontend.middleware import AccessRecord, access_record
from subway.frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    Usage,
)
from subway.ipc.config import EngineConfig

log = logging.getLogger("subway.frontend")

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServingContext:
    config: EngineConfig
    engine: EngineClient
    tokenizer: object
    metrics: Metrics | None = None
    offload: Offload = field(init=False)  # parsing, chat templates, tokenization

    def __post_init__(self) -> None:
        self.offload = Offload(self.config.server.template_timeout)

    def limits(self) -> Limits:
        link = self.engine.link
        if link.info is None or not link.ready:
            raise APIError(503, link.error or "the engine is not ready yet")
        return Limits(
            max_model_len=link.info.max_model_len,
            vocab_size=link.info.vocab_size,
            chat_max_tokens=self.config.server.default_max_tokens or None,
        )

    def timeout(self, requested: float | None) -> float | None:
        """The request's time limit: its own `timeout`, at most the server's (0: none)."""
        server = self.config.server.request_timeout or None
        if requested is None:
            return server
        return min(requested, server) if server else requested


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def serve(ctx: ServingContext, api: API, request: Request, record: AccessRecord) -> Response:
    """One HTTP request of `api`, start to end; `record` is its access-log record."""
    body = await request.body()
    req = await ctx.offload.run(parse, api.request, body, what="parsing the request body")
    check_request(req, ctx.config)
    req, ignored = client_scheduling(req, ctx.config)
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else None
    request_id = new_id(api.id_prefix)
    job = await ctx.offload.run(
        api.prepare, req, ctx.tokenizer, ctx.limits(), what=api.preparing, param=api.input
    )
    group = admit(ctx, req, request_id, job, record, request)
    view = api.view(req, job, request_id, ctx.config.model.served_model_name, ctx.tokenizer)
    if req.stream:
        return StreamingResponse(_sse(view, group), media_type="text/event-stream", headers=headers)
    try:
        body = await view.whole(group)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    return JSONResponse(body.model_dump(), headers=headers)


def admit(
    ctx: ServingContext,
    req: SamplingRequest,
    request_id: str,
    job: Job,
    record: AccessRecord,
    request: Request | None = None,
) -> ChoiceGroup | None:
    """Submit the job's choices now (None: nothing to ask the engine); refusals raise APIError.

    `request`: the HTTP request, whose disconnect aborts the choices."""
    record.request_id = request_id
    record.prompt_tokens = job.prompt_tokens
    if not job.run_engine:
        return None
    param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    check_job_size(job.prompt_tokens, req.n, ctx.config, param)
    try:
        return ChoiceGroup(
            ctx.engine,
            ctx.tokenizer,
            fan_out(req, request_id, job),
            request=request,
            metrics=ctx.metrics,
            timeout=ctx.timeout(req.timeout),
            on_event=record.note,
        )
    except Exception as e:
        raise engine_failure(e) from e


def engine_failure(e: Exception) -> APIError:
    """The API error that a failure to run a request is."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine cannot serve: {e}")
    if isinstance(e, GenerationError):
        return APIError(500, str(e))
    log.error("request failed: %r", e)
    return APIError(500, f"internal error: {type(e).__name__}")


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def _sse(view: View, group: ChoiceGroup | None) -> AsyncIterator[str]:
    """The streamed answer: each body as an event, then `[DONE]`."""
    try:
        async for body in view.chunks(group):
            yield sse(body)
    except ClientDisconnected:
        return  # nobody is listening
    except Exception as e:  # the response has started: the error is its last event
        yield sse(engine_failure(e).body())
    finally:
        if group is not None:
            group.close()
    yield SSE_DONE


# ---------------------------------------------------------------- the answers


class View:
    """What both APIs' answers share: the choices merged, the usage."""

    def __init__(self, req: SamplingRequest, job: Job, request_id: str, model: str, tokenizer):
        self.req = req
        self.job = job
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.n = len(job.prompts) * req.n  # choice i belongs to prompt i // req.n

    def usage(self, completion_tokens: int) -> Usage:
        prompt_tokens = self.job.prompt_tokens
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    async def whole(self, group: ChoiceGroup | None) -> BaseModel:
        """The answer in one body, once every choice has ended (no group: nothing to run)."""
        texts = self.openings()
        counts = [0] * self.n
        finish: list[str | None] = ["length" if group is None else None] * self.n
        lps = [self.new_logprobs() for _ in range(self.n)]
        if group is not None:
            async for raw in group.events():
                ev = self.shown(raw)
                i = ev.index
                if lps[i] is not None:
                    self.add_logprobs(lps[i], ev, len(texts[i]))
                texts[i] += ev.text
                counts[i] += len(ev.token_ids)
                finish[i] = ev.finish_reason or finish[i]
        return self.response(texts, lps, finish, self.usage(sum(counts)))

    # What each API does its own way.

    def openings(self) -> list[str]:
        """Each choice's text before its first event."""
        return [""] * self.n

    def shown(self, ev: ChoiceEvent) -> ChoiceEvent:
        return ev

    def new_logprobs(self):
        raise NotImplementedError

    def add_logprobs(self, into, ev: ChoiceEvent, offset: int) -> None:
        raise NotImplementedError

    def response(self, texts, lps, finish, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def chunks(self, group: ChoiceGroup | None) -> AsyncIterator[BaseModel]:
        raise NotImplementedError


class ChatView(View):
    req: ChatCompletionRequest

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )

    async def chunks(self, group: ChoiceGroup) -> AsyncIterator[ChatCompletionChunk]:
        req = self.req
        for i in range(req.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=i, delta=delta)])
        completion_tokens = 0
        async for ev in group.events():
            completion_tokens += len(ev.token_ids)
            if not (ev.text or ev.finish_reason or ev.logprobs):
                continue
            lp = (
                chat_logprobs(self.tokenizer, ev.logprobs) if ev.logprobs and req.logprobs else None
            )
            delta = DeltaMessage(content=ev.text or None)
            choice = ChatChunkChoice(
                index=ev.index, delta=delta, logprobs=lp, finish_reason=ev.finish_reason
            )
            yield self._chunk([choice])
        if req.include_usage:
            yield self._chunk([], self.usage(completion_tokens))

    def new_logprobs(self) -> ChatLogprobs | None:
        return ChatLogprobs(content=[]) if self.req.logprobs else None

    def add_logprobs(self, into: ChatLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.logprobs is not None and into.content is not None:
            into.content += chat_logprobs(self.tokenizer, ev.logprobs).content or []

    def response(self, texts, lps, finish, usage: Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=texts[i]),
                logprobs=lps[i],
                finish_reason=finish[i],
            )
            for i in range(self.n)
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )


class CompletionView(View):
    req: CompletionRequest

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None):
        return CompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def openings(self) -> list[str]:
        """The echoes: each choice's prompt, when `echo`."""
        if not self.req.echo:
            return [""] * self.n
        prompts = [self.job.prompts[i // self.req.n] for i in range(self.n)]
        return [p.text if p.text is not None else self.tokenizer.decode(p.ids) for p in prompts]

    def shown(self, ev: ChoiceEvent) -> ChoiceEvent:
        """With max_tokens 0 the generated token is dropped: the choice ends at its prompt."""
        if not self.job.no_output:
            return ev
        return ChoiceEvent(
            ev.index,
            finish_reason="length" if ev.finish_reason is not None else None,
            prompt_logprobs=ev.prompt_logprobs,
        )

    async def chunks(self, group: ChoiceGroup | None) -> AsyncIterator[CompletionChunk]:
        req = self.req
        echoes = self.openings()
        offsets = [0] * self.n
        completion_tokens = 0
        pending_echo = [bool(e) for e in echoes]  # not shown yet
        want_prompt_lps = req.echo and req.logprobs is not None
        if group is None:  # max_tokens 0, no logprobs: the echoes and we are done
            for i, echo in enumerate(echoes):
                yield self._chunk([CompletionChoice(index=i, text=echo, finish_reason="length")])
        else:
            if not want_prompt_lps:
                for i, echo in enumerate(echoes):
                    if echo:
                        yield self._chunk([CompletionChoice(index=i, text=echo)])
                        offsets[i] = len(echo)
                        pending_echo[i] = False
            async for raw in group.events():
                ev = self.shown(raw)
                completion_tokens += len(ev.token_ids)
                i = ev.index
                lp = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs()
                    if ev.prompt_logprobs is not None and want_prompt_lps:
                        extend(lp, completion_logprobs(self.tokenizer, ev.prompt_logprobs, 0))
                    if ev.logprobs is not None:
                        start = offsets[i] + len(echoes[i] if pending_echo[i] else "")
                        extend(lp, completion_logprobs(self.tokenizer, ev.logprobs, start))
                text = ev.text
                if pending_echo[i]:
                    text = echoes[i] + text
                    pending_echo[i] = False
                if not (text or ev.finish_reason or (lp is not None and lp.tokens)):
                    continue
                offsets[i] += len(text)
                choice = CompletionChoice(
                    index=i, text=text, logprobs=lp, finish_reason=ev.finish_reason
                )
                yield self._chunk([choice])
        if req.include_usage:
            yield self._chunk([], self.usage(completion_tokens))

    def new_logprobs(self) -> CompletionLogprobs | None:
        return CompletionLogprobs() if self.req.logprobs is not None else None

    def add_logprobs(self, into: CompletionLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.prompt_logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.prompt_logprobs, 0))
        if ev.logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.logprobs, offset))

    def response(self, texts, lps, finish, usage: Usage) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=texts[i], logprobs=lps[i], finish_reason=finish[i])
            for i in range(self.n)
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )


@dataclass(frozen=True)
class API:
    """One generation endpoint, as the pipeline sees it."""

    request: type[SamplingRequest]
    id_prefix: str
    prepare: Callable[..., Job]  # (request, tokenizer, limits): the engine's work
    view: type[View]  # its bodies
    input: str  # the field that holds the prompt
    preparing: str  # what `prepare` does, as an error message says it


CHAT = API(ChatCompletionRequest, "chatcmpl", chat_job, ChatView, "messages",
           "rendering the chat template and tokenizing")  # fmt: skip
COMPLETIONS = API(CompletionRequest, "cmpl", completion_job, CompletionView, "prompt",
                  "tokenizing the prompt")  # fmt: skip


def add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`/v1/completions` and `/v1/chat/completions`, both through `serve`."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(ctx, COMPLETIONS, request, access_record())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(ctx, CHAT, request, access_record())
