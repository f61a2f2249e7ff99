"""The frontend process: an OpenAI-compatible HTTP server in front of the engine client.

`build_app` makes the FastAPI app from a config, an `Engine` and a
tokenizer (nothing global); the app starts and closes the client (and the
native ZMQ endpoint) in its lifespan, so their sockets live on the server's
event loop. `GuardMiddleware` wraps it all (API key, size limits, body timeout,
access log); below it, uvicorn speaks HTTP through `http_limits.guarded_h11`
(header timeout, connection limit). `run_frontend` is the process main.

Routes, added by group: `/health`, `/metrics`, `/version` and `/v1/models`
(`add_status_routes`), `/v1/completions` and `/v1/chat/completions`
(`pipeline.add_generation_routes`), `/tokenize` and `/detokenize` (`add_token_routes`),
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (`lora_api.add_lora_routes`),
`/v1/responses...` (`responses_api.add_responses_routes`), `/v1/messages`
(`messages_api.add_messages_routes`), `/v1/embeddings` and `/v1/score`
(`embeddings.add_embedding_routes`).

`/tokenize` and `/detokenize` do on the event loop only what does not grow with
the request: parsing, the checks of every id, decoding (`decode_long`, a bounded
number of ids a tokenizer call), the token strings and the rendering of the
answer (`render_fields`, under `--max-response-bytes`) all run on the offload
threads, in steps that each hold the GIL briefly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from subway import __version__
from subway.frontend.chat import chat_prompt
from subway.frontend.detokenizer import decode_long
from subway.frontend.embeddings import add_embedding_routes
from subway.frontend.engine import Engine
from subway.frontend.engine_group import EngineGroup, GroupLink
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.http_limits import guarded_h11
from subway.frontend.inputs import Limits, check_model, check_token_ids, encode, parse
from subway.frontend.liveness import serve_liveness
from subway.frontend.lora import LoraRegistry
from subway.frontend.lora_api import add_lora_routes, model_cards
from subway.frontend.messages_api import add_messages_routes
from subway.frontend.messages_protocol import error_json
from subway.frontend.messages_tokens import add_count_tokens_route
from subway.frontend.metrics import Metrics
from subway.frontend.middleware import (
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    GuardMiddleware,
)
from subway.frontend.pipeline import ServingContext, add_generation_routes
from subway.frontend.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from subway.frontend.responses import (
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    TooLarge,
    VersionResponse,
    render_fields,
)
from subway.frontend.responses_api import add_responses_routes
from subway.frontend.scheduler_link import SchedulerLink
from subway.frontend.zmq_endpoint import ClientEndpoint
from subway.ipc.config import EngineConfig

log = logging.getLogger("subway.frontend")


def load_tokenizer(config: EngineConfig):
    """The tokenizer AutoTokenizer would pick, without AutoTokenizer where the folder names
    its class: AutoTokenizer reads the model's config through code that imports torch,
    3-5 s of every frontend's start on a 2-core machine (and a frontend has no use for
    torch). Like AutoTokenizer, a named class's fast variant is preferred. A folder whose
    tokenizer_config.json names no class transformers has (remote code, a missing file)
    goes to AutoTokenizer itself."""
    import transformers

    path = config.model.tokenizer or config.model.path
    named = _named_tokenizer_class(path)
    for name in ([named] if named.endswith("Fast") else [named + "Fast", named]) if named else []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def _named_tokenizer_class(path: str) -> str:
    """tokenizer_config.json's `tokenizer_class` in a local folder ("" where there is none)."""
    import json
    import os

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return ""
    return named if isinstance(named, str) and named.isidentifier() else ""


def build_app(
    config: EngineConfig,
    engine: Engine,
    tokenizer=None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> FastAPI:
    """The HTTP app over one engine's client or a group of engines (data parallel).
    `tokenizer` defaults to the one `config` names."""
    group = engine if isinstance(engine, EngineGroup) else None
    lora = LoraRegistry(config)  # checks each --lora-modules adapter (LoraError)
    metrics = Metrics(
        config.model.served_model_name,
        # Read at each scrape: `endpoint` is made below, from the context that holds `metrics`.
        lambda: engine.link.num_rejected + (endpoint.rejected if endpoint is not None else 0),
        roles=group.roles if group is not None else None,
        lora_names=lora.names,
    )
    for adapter, _ in lora.adapters():
        metrics.adapter_added(adapter.name)
    if group is not None:
        group.on_route = metrics.observe_route
    tok = tokenizer if tokenizer is not None else load_tokenizer(config)
    ctx = ServingContext(config, engine, tok, metrics, lora)
    address = config.client_address
    endpoint = ClientEndpoint(ctx, address) if address else None

    app = FastAPI(
        title="Subway", lifespan=_lifespan(engine, endpoint), docs_url=None, redoc_url=None
    )
    app.add_middleware(
        GuardMiddleware,
        api_key=config.server.api_key,
        max_body_bytes=max_body_bytes,
        max_header_bytes=max_header_bytes,
        body_timeout=config.server.body_timeout,
    )
    add_error_handlers(app)
    add_status_routes(app, config, engine, metrics, lora)
    add_generation_routes(app, ctx)
    add_token_routes(app, ctx)
    add_lora_routes(app, ctx)
    add_messages_routes(app, ctx)
    add_count_tokens_route(app, ctx)
    add_responses_routes(app, ctx)
    add_embedding_routes(app, ctx)
    return app


def _lifespan(
    engine: Engine, endpoint: ClientEndpoint | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine's client (then the native ZMQ endpoint) start and
    close on the server's event loop, where their sockets must live."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            if endpoint is not None:
                await endpoint.start()
            yield
        finally:
            if endpoint is not None:
                await endpoint.aclose()
            await engine.aclose()

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style error body (`APIError.response`), or as
    Anthropic's on the Messages API's paths (`messages_protocol.error_json`)."""
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_json(e, request.url.path)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_json(APIError(400, str(e)), request.url.path)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_json(APIError(e.status_code, str(e.detail)), request.url.path)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    return error_json(APIError(500, f"internal error: {type(e).__name__}"), request.url.path)


def add_status_routes(
    app: FastAPI,
    config: EngineConfig,
    engine: Engine,
    metrics: Metrics,
    lora: LoraRegistry | None = None,
) -> None:
    """`/health`, `/metrics`, `/version` and `/v1/models` (the base model and its LoRA
    adapters)."""
    lora = lora if lora is not None else LoraRegistry(config)
    group = engine if isinstance(engine, EngineGroup) else None

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if group is not None and len(group.clients) > 1:
            return _group_health(group)
        return _engine_health(engine.link)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if group is not None:
            for i, c in enumerate(group.clients):
                if c.link.stats is not None:
                    metrics.observe_stats(c.link.stats, engine=i)
        elif engine.link.stats is not None:
            metrics.observe_stats(engine.link.stats)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models() -> ModelList:
        info = engine.link.info
        max_len = info.max_model_len if info else None
        return ModelList(data=model_cards(lora, max_len))


def _group_health(group: EngineGroup) -> Response:
    """`/health` of several engines: 200 while one can serve ("degraded" unless all can),
    503 when none can; each engine's state in the body."""
    serving, states = group.health()
    if serving:
        whole = all(s["state"] == "serving" for s in states)
        body = {"status": "ok" if whole else "degraded", "engines": states}
        return JSONResponse(body, status_code=200)
    reason = "; ".join(f"engine {s['engine']}: {s['state']}" for s in states)
    body = {"status": "unhealthy", "reason": reason, "engines": states}
    return JSONResponse(body, status_code=503)


def _engine_health(link: SchedulerLink | GroupLink) -> Response:
    """`/health` of one engine: an empty 200, or 503 with the reason it cannot serve."""
    if link.healthy:
        return Response(status_code=200)
    reason = link.error or ("engine not ready" if not link.ready else "engine silent")
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


def add_token_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`/tokenize` and `/detokenize`: on the event loop only what does not grow with the
    request; the rest on the offload threads (the module's docstring)."""
    config, tok = ctx.config, ctx.tokenizer
    max_bytes = config.server.max_response_bytes

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: Request) -> Response:
        body = await request.body()
        req = await ctx.offload.run(parse, TokenizeRequest, body, what="parsing the request body")
        check_model(req, config, ctx.lora)  # an adapter's name too: the tokenizer is the base's
        limits = ctx.limits()
        ids = await _token_ids(ctx, req, limits)
        content = await ctx.offload.run(
            _tokenized, tok, ids, req.return_token_strs, limits, max_bytes,
            what="rendering the tokens",
        )  # fmt: skip
        return Response(content, media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: Request) -> Response:
        body = await request.body()
        req = await ctx.offload.run(parse, DetokenizeRequest, body, what="parsing the request body")
        check_model(req, config, ctx.lora)
        content = await ctx.offload.run(
            _detokenized, tok, req.tokens, ctx.limits(), max_bytes,
            what="detokenizing", param="tokens",
        )  # fmt: skip
        return Response(content, media_type="application/json")


async def _token_ids(ctx: ServingContext, req: TokenizeRequest, limits: Limits) -> list[int]:
    """The ids `/tokenize` answers with: its messages through the chat template, or its
    prompt (on an offload thread)."""
    tok = ctx.tokenizer
    if req.messages is None:
        return await ctx.offload.run(
            encode, tok, req.prompt, req.add_special_tokens, "prompt",
            what="tokenizing the prompt", param="prompt",
        )  # fmt: skip
    try:
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt
        )
    except ValidationError as e:
        raise from_validation_error(e) from e
    return await ctx.offload.run(
        lambda: chat_prompt(chat, tok, limits, check_length=False).ids,
        what="rendering the chat template and tokenizing",
        param="messages",
    )


def _tokenized(tok, ids: list[int], strs: bool, limits: Limits, max_bytes: int) -> bytes:
    """`/tokenize`'s answer (on an offload thread)."""
    fields = {
        "count": len(ids),
        "max_model_len": limits.max_model_len,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids) if strs else None,
    }
    return _bounded(fields, max_bytes)


def _detokenized(tok, ids: list[int], limits: Limits, max_bytes: int) -> bytes:
    """`/detokenize`'s answer (on an offload thread)."""
    check_token_ids(ids, limits, "tokens")
    return _bounded({"prompt": decode_long(tok, ids)}, max_bytes)


def _bounded(fields: dict[str, object], max_bytes: int) -> bytes:
    try:
        return render_fields(fields, max_bytes)
    except TooLarge:
        raise APIError(
            400,
            f"the response would be larger than this server's limit of {max_bytes} bytes "
            "(--max-response-bytes)",
        ) from None


def run_frontend(config: EngineConfig) -> int:
    """The frontend process: serve until SIGTERM/SIGINT (graceful), then clean up. Returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tokenizer = load_tokenizer(config)
    engine = EngineGroup(config)
    app = build_app(config, engine, tokenizer)
    serve_liveness(app, config, engine)  # the launcher's watch, off the HTTP slots
    server = DrainingServer(
        engine,
        config.server.shutdown_timeout,
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            loop="uvloop",
            http=guarded_h11(config.server.header_timeout, config.server.max_connections),
            h11_max_incomplete_event_size=4 * MAX_HEADER_BYTES,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,  # the drain happened before uvicorn is told to stop
        ),
    )
    # uvicorn handles SIGTERM/SIGINT (stop accepting, drain, run the lifespan's exit), then
    # re-raises the signal to the handlers it found: make those no-ops so we return a code.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return int(e.code) if isinstance(e.code, int) else 1
    finally:
        engine.close()  # idempotent: covers a startup that failed after the lifespan began
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def _ignore(signum: int, frame: object) -> None:
    pass


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before it stops: on SIGTERM/SIGINT new requests get 503 and
    `/health` says draining, in-flight requests may finish for `drain_timeout` seconds,
    then the rest are aborted (their streams end with finish_reason "abort") and the
    server stops. A second SIGINT stops it at once; a second SIGTERM changes nothing (the
    launcher and systemd may both send one)."""

    def __init__(self, engine: Engine, drain_timeout: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.engine.draining and sig == signal.SIGTERM:
            return
        if self.engine.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.engine.draining = True
        log.info("draining: %d requests in flight", self.engine.num_in_flight)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        engine, loop = self.engine, asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.info("drain timed out: aborting %d requests", engine.abort_all())
            deadline = loop.time() + 3.0  # their abort deltas come within a step or two
            while engine.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True
