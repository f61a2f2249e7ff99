"""The frontend process: an OpenAI-compatible HTTP server in front of the engine client.

`build_app` makes the FastAPI app from a config, an `EngineClient` and a
tokenizer (nothing global); the app starts and closes the client in its
lifespan, so the client's sockets live on the server's event loop.
`run_frontend` is the process main.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from subway.frontend.chat import create_chat_completion
from subway.frontend.completions import create_completion
from subway.frontend.engine_client import EngineClient
from subway.frontend.errors import APIError
from subway.frontend.metrics import Metrics
from subway.frontend.protocol import ModelCard, ModelList
from subway.frontend.serving import ServingContext
from subway.ipc.config import EngineConfig
from subway.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model

log = logging.getLogger("subway.frontend")


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer

    path = config.tokenizer or config.model
    if not path:
        path = ensure_default_model(quiet=True)
    return AutoTokenizer.from_pretrained(path)


def build_app(config: EngineConfig, engine: EngineClient, tokenizer=None) -> FastAPI:
    """The HTTP app. `tokenizer` defaults to the one `config` names."""
    if not config.served_model_name:  # no --model: the default model
        config = config.replace(served_model_name=DEFAULT_MODEL_NAME)
    metrics = Metrics(config.served_model_name)
    tok = tokenizer if tokenizer is not None else load_tokenizer(config)
    ctx = ServingContext(config, engine, tok, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.aclose()

    app = FastAPI(title="Subway", lifespan=lifespan)
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail)).response()

    def authorize(request: Request) -> None:
        """A dependency, not a middleware: BaseHTTPMiddleware gets in the way of streaming."""
        if config.api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                raise APIError(401, "invalid or missing API key")

    v1 = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return Response(status_code=200)
        reason = engine.error or ("engine not ready" if not engine.ready else "engine silent")
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if engine.stats is not None:
            metrics.observe_stats(engine.stats)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> ModelList:
        max_len = engine.info.max_model_len if engine.info else None
        return ModelList(data=[ModelCard(id=config.served_model_name, max_model_len=max_len)])

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    return app


def run_frontend(config: EngineConfig) -> int:
    """The frontend process: serve until SIGTERM/SIGINT (graceful), then clean up. Returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    tokenizer = load_tokenizer(config)
    engine = EngineClient(config)
    app = build_app(config, engine, tokenizer)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(config.shutdown_timeout)),
        )
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
