"""The request pipeline that `/v1/completions` and `/v1/chat/completions` share, and
their routes (`add_generation_routes`).

One request goes through the same stages whichever the endpoint:

1. `inputs.py`: the body is parsed and checked, and becomes a `Job` (prompt ids
   and sampling parameters); parsing and the job (chat template, tokenization)
   run off the event loop, time-limited (`admission.Offload`); then each
   distinct grammar of the job (structured outputs, tool calls) is compiled
   once, in a worker process under `--grammar-timeout` (`check_grammars`), so
   that an invalid or too slow one is a 400 and never reaches the engine;
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

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from subway.frontend.admission import Offload, check_job_size
from subway.frontend.chat import ChatView, chat_job
from subway.frontend.choices import (
    ChoiceGroup,
    ClientDisconnected,
    GenerationError,
    fan_out,
)
from subway.frontend.engine import Engine
from subway.frontend.engine_client import EngineDeadError, QueueFullError
from subway.frontend.errors import APIError
from subway.frontend.grammar import GrammarCheck, request_constraint
from subway.frontend.grammar_pool import GrammarPool, PoolError, PoolStartError
from subway.frontend.inputs import (
    IGNORED_HEADER,
    Job,
    Limits,
    R,
    check_request,
    client_scheduling,
    completion_job,
    parse,
    runs_per_prompt,
)
from subway.frontend.lora import LoraRegistry
from subway.frontend.metrics import Metrics
from subway.frontend.middleware import AccessRecord, access_record
from subway.frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from subway.frontend.views import CompletionView, View, render_json
from subway.ipc.config import EngineConfig

log = logging.getLogger("subway.frontend")

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServingContext:
    config: EngineConfig
    engine: Engine
    tokenizer: object
    metrics: Metrics | None = None
    lora: LoraRegistry | None = None  # the adapters served; None: made from the config
    offload: Offload = field(init=False)  # parsing, chat templates, tokenization
    _grammar: GrammarCheck | None = field(init=False, default=None)
    _grammar_start: asyncio.Task | None = field(init=False, default=None)
    _grammar_failed: tuple[tuple, str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.offload = Offload(self.config.server.template_timeout)
        if self.lora is None:
            self.lora = LoraRegistry(self.config)

    async def grammar_check(self) -> GrammarCheck:
        """The check for the engine's vocabulary, made on first use: its compile processes
        start in a few seconds (xgrammar's import, the tokenizer), outside any request's
        grammar time limit. Requests that arrive meanwhile wait for the same start; a
        cancelled request does not cancel it."""
        info = self.engine.link.info
        if info is None:
            raise APIError(503, "the engine is not ready yet")
        vocab = (info.vocab_size, list(info.eos_token_ids))
        loop = asyncio.get_running_loop()
        check = self._grammar
        if check is not None and check.vocab == vocab and check.pool.loop is loop:
            if not check.pool.broken:
                return check
        if self._grammar_failed is not None and self._grammar_failed[0] == vocab:
            raise APIError(500, "structured outputs are not available for this model")
        start = self._grammar_start
        if start is None or start.done() or start.get_loop() is not loop:
            start = self._grammar_start = loop.create_task(self._start_grammar(vocab))
            start.add_done_callback(_retrieved)  # its error reaches every waiter, if any
        return await asyncio.shield(start)

    async def _start_grammar(self, vocab: tuple[int, list[int]]) -> GrammarCheck:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None
        server = self.config.server
        path = getattr(self.tokenizer, "name_or_path", "") or (
            self.config.model.tokenizer or self.config.model.path
        )
        pool = GrammarPool(path, vocab[0], vocab[1], server.grammar_workers)
        try:
            await pool.start()
        except PoolStartError as e:  # a tokenizer xgrammar cannot read: no structured outputs
            log.error("cannot compile grammars for this tokenizer: %s", e)
            self._grammar_failed = (vocab, str(e))
            raise APIError(500, "structured outputs are not available for this model") from e
        except PoolError as e:
            log.error("the grammar compiler did not start: %s", e)
            raise APIError(503, f"structured outputs are not available now: {e}",
                           headers={"Retry-After": "1"}) from e  # fmt: skip
        on_compile = self.metrics.observe_grammar_compile if self.metrics else None
        self._grammar = GrammarCheck(pool, server.grammar_timeout, vocab, on_compile)
        return self._grammar

    def close(self) -> None:
        """Stop the grammar compile processes (they also stop when this process ends)."""
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None

    def limits(self) -> Limits:
        link = self.engine.link
        if link.info is None or not link.ready:
            raise APIError(503, link.error or "the engine is not ready yet")
        return Limits(
            max_model_len=link.info.max_model_len,
            vocab_size=link.info.vocab_size,
            chat_max_tokens=self.config.server.default_max_tokens or None,
            reasoning_parser=self.config.server.reasoning_parser,
            tool_call_parser=self.config.server.tool_call_parser,
        )

    def timeout(self, requested: float | None) -> float | None:
        """The request's time limit: its own `timeout`, at most the server's (0: none)."""
        server = self.config.server.request_timeout or None
        if requested is None:
            return server
        return min(requested, server) if server else requested


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def serve(ctx: ServingContext, api: API, request: Request, record: AccessRecord) -> Response:
    """One HTTP request of `api`, start to end; `record` is its access-log record."""
    body = await request.body()
    req = await ctx.offload.run(parse, api.request, body, what="parsing the request body")
    req, job, ignored = await prepare(ctx, api, req)
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else None
    request_id = new_id(api.id_prefix)
    group = admit(ctx, req, request_id, job, record, request)
    # The answer names the model the request named: an adapter's name echoes back.
    model = req.model or ctx.config.model.served_model_name
    view = api.view(req, job, request_id, model, ctx.tokenizer, ctx.config.server)
    if req.stream:
        return StreamingResponse(_sse(view, group), media_type="text/event-stream", headers=headers)
    try:
        body = await view.whole(group)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise engine_failure(e) from e
    # Rendered on a thread, a choice at a time (`render_json`): an answer may be megabytes
    # (up to --max-response-bytes), and the event loop serves every other stream meanwhile.
    content = await asyncio.to_thread(render_json, body)
    return Response(content, media_type="application/json", headers=headers)


async def prepare(ctx: ServingContext, api: API, req: R) -> tuple[R, Job, list[str]]:
    """A parsed request made the engine's work, the one way for HTTP and the native ZMQ
    endpoint: checked against the config, its `model` resolved (the base model or a LoRA
    adapter: `Job.lora`), its client scheduling fields kept or dropped (the names of those
    dropped), its prompt rendered and tokenized (`api.prepare`, on a worker thread under
    `--template-timeout`), its grammars checked."""
    lora = check_request(req, ctx.config, ctx.lora)
    req, ignored = client_scheduling(req, ctx.config)
    job = await ctx.offload.run(
        api.prepare, req, ctx.tokenizer, ctx.limits(), what=api.preparing, param=api.input
    )
    job.lora = lora
    await check_grammars(ctx, job, req)
    return req, job, ignored


async def check_grammars(ctx: ServingContext, job: Job, req: SamplingRequest) -> None:
    """Check each distinct grammar of the job's sampling once (`GrammarCheck`): an invalid
    one is a 400 with xgrammar's message, one that compiles slower than `--grammar-timeout`
    a 400 too (its compile process is killed and replaced, so it holds no CPU after)."""
    grammars = list(dict.fromkeys(sp.grammar for sp in job.sampling if sp.grammar is not None))
    if not grammars:
        return
    check = await ctx.grammar_check()
    given = request_constraint(req)  # the field named in an error, when it is the request's
    for grammar in grammars:
        param = given[0] if given is not None and given[1] == grammar else None
        await check.check(grammar, param)


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
    check_job_size(job.prompt_tokens, runs_per_prompt(req), ctx.config, param)
    if ctx.lora is not None and not ctx.lora.serves(job.lora):  # unloaded while prepared
        raise APIError(404, f"the model `{req.model}` does not exist (it was unloaded)", "model")
    try:
        group = ChoiceGroup(
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
    if job.lora and ctx.metrics is not None and req.model is not None:
        ctx.metrics.observe_lora_requests(req.model, len(group.streams))
    return group


@dataclass
class ChatRun:
    """A chat request admitted for another API's door (`/v1/responses`, `/v1/messages`):
    its view renders the choices as chat completions, which that API translates."""

    req: ChatCompletionRequest
    view: ChatView
    group: ChoiceGroup | None
    ignored: list[str]  # client scheduling fields dropped (IGNORED_HEADER)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


async def start_chat(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    request: Request | None = None,
) -> ChatRun:
    """`req` through the chat pipeline's stages (`prepare`, `admit`): the one request path
    that every door shares; refusals raise APIError. `request`: the HTTP request, whose
    disconnect aborts the choices."""
    req, job, ignored = await prepare(ctx, CHAT, req)
    group = admit(ctx, req, request_id, job, access_record(), request)
    model = req.model or ctx.config.model.served_model_name
    view = ChatView(req, job, request_id, model, ctx.tokenizer, ctx.config.server)
    return ChatRun(req, view, group, ignored)


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
