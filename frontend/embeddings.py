"""`POST /v1/embeddings` (OpenAI's) and `POST /v1/score` (vLLM's, for pairs): vectors of the
served model's final hidden states, pooled, from the same engine that generates.

Each input is an engine request like a prompt with one token to make
(`SamplingParams.pooling`, `worker/pooling.py`): it is admitted, queued, chunked
under `--max-num-batched-tokens` and batched with generation as any prompt, and its
vector comes back with its one token, which is dropped. The vector is the last
position's hidden state or the mean of all positions' (`--embedding-pooling`, or the
request's `pooling`), normalised to unit length unless the request says
`normalize: false`. `encoding_format` "base64" is the float32 bytes, as OpenAI's
clients ask by default. `dimensions` (Matryoshka truncation) is refused: no model
served here is trained for it. A score is the cosine of the two texts' vectors.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from subway.frontend.admission import check_job_size
from subway.frontend.choices import ChoiceGroup, ChoiceSpec, ClientDisconnected
from subway.frontend.errors import APIError
from subway.frontend.inputs import Prompt, check_model, parse, prompts_of
from subway.frontend.middleware import access_record
from subway.frontend.pipeline import ServingContext, engine_failure, new_id
from subway.ipc.messages import SamplingParams

MAX_ITEMS = 2048  # inputs (or pairs) of one request at most, as OpenAI's embeddings allow


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class EmbeddingRequest(Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(max_length=MAX_ITEMS)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean"] | None = None  # vLLM-style extensions
    normalize: bool = True


class ScoreRequest(Strict):
    model: str | None = None
    text_1: str | list[str] = Field(max_length=MAX_ITEMS)
    text_2: str | list[str] = Field(max_length=MAX_ITEMS)
    pooling: Literal["last", "mean"] | None = None


def pairs(req: ScoreRequest) -> tuple[list[str], list[str]]:
    """The texts scored against each other: one against many, or many one by one."""
    one, two = req.text_1, req.text_2
    if isinstance(one, str):
        one = [one] * (1 if isinstance(two, str) else len(two))
    if isinstance(two, str):
        two = [two] * len(one)
    if len(one) != len(two) or not one:
        raise APIError(400, f"text_1 has {len(one)} texts and text_2 {len(two)}: give one "
                       "text against many, or as many of each", "text_2")  # fmt: skip
    return one, two


async def embed(
    ctx: ServingContext, prompts: list[Prompt], pooling: str, lora: int, request: Request,
    param: str,
) -> list[np.ndarray]:  # fmt: skip
    """The prompts' vectors (float32, not normalised), in order; refusals raise APIError."""
    limit = ctx.config.server.max_seqs_per_request
    if limit > 0 and len(prompts) > limit:
        raise APIError(400, f"{len(prompts)} inputs; this server takes at most {limit} per "
                       "request (--max-seqs-per-request)", param)  # fmt: skip
    tokens = sum(len(p.ids) for p in prompts)
    check_job_size(tokens, 1, ctx.config, param)
    record = access_record()
    record.request_id = request_id = new_id("embd")
    record.prompt_tokens = tokens
    sampling = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    specs = [ChoiceSpec(i, f"{request_id}-{i}", p.ids, sampling, [], lora=lora)
             for i, p in enumerate(prompts)]  # fmt: skip
    try:
        group = ChoiceGroup(ctx.engine, ctx.tokenizer, specs, request=request,
                            metrics=ctx.metrics, timeout=ctx.timeout(None))  # fmt: skip
    except Exception as e:
        raise engine_failure(e) from e
    vectors: list[np.ndarray | None] = [None] * len(prompts)
    try:
        async for ev in group.events():
            if ev.embedding is not None:
                vectors[ev.index] = np.frombuffer(ev.embedding, dtype="<f4")
            elif ev.finish_reason == "abort":
                raise APIError(503, "the request's time ran out before its vectors came")
    finally:
        group.close()
    if any(v is None for v in vectors) or len({len(v) for v in vectors}) != 1:
        raise APIError(500, "the engine returned no vector, or vectors of unequal sizes")
    return vectors  # type: ignore[return-value]


def unit(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def usage(prompts: list[Prompt]) -> dict:
    n = sum(len(p.ids) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


def encoded(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return v.tolist()


async def embeddings(ctx: ServingContext, request: Request) -> Response:
    body = await request.body()
    req = await ctx.offload.run(parse, EmbeddingRequest, body, what="parsing the request body")
    lora = check_model(req, ctx.config, ctx.lora)
    if req.dimensions is not None:
        raise APIError(400, "dimensions is not supported by this model", "dimensions")
    prompts = await ctx.offload.run(prompts_of, req.input, ctx.tokenizer, ctx.limits(), "input",
                                    what="tokenizing the input", param="input")  # fmt: skip
    pooling = req.pooling or ctx.config.server.embedding_pooling
    try:
        vectors = await embed(ctx, prompts, pooling, lora, request, "input")
    except ClientDisconnected:
        return Response(status_code=499)
    data = [
        {"object": "embedding", "index": i,
         "embedding": encoded(unit(v) if req.normalize else v, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]  # fmt: skip
    model = req.model or ctx.config.model.served_model_name
    return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage(prompts)})


async def score(ctx: ServingContext, request: Request) -> Response:
    body = await request.body()
    req = await ctx.offload.run(parse, ScoreRequest, body, what="parsing the request body")
    lora = check_model(req, ctx.config, ctx.lora)
    one, two = pairs(req)
    texts = list(dict.fromkeys(one + two))  # each distinct text embedded once
    prompts = await ctx.offload.run(prompts_of, texts, ctx.tokenizer, ctx.limits(), "text_1",
                                    what="tokenizing the texts", param="text_1")  # fmt: skip
    pooling = req.pooling or ctx.config.server.embedding_pooling
    try:
        vectors = await embed(ctx, prompts, pooling, lora, request, "text_1")
    except ClientDisconnected:
        return Response(status_code=499)
    of = {t: unit(v) for t, v in zip(texts, vectors, strict=True)}
    data = [{"object": "score", "index": i, "score": float(np.dot(of[a], of[b]))}
            for i, (a, b) in enumerate(zip(one, two, strict=True))]  # fmt: skip
    return JSONResponse({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": req.model or ctx.config.model.served_model_name, "data": data,
        "usage": usage(prompts),
    })  # fmt: skip


def add_embedding_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`/v1/embeddings` and `/v1/score` (also `/score`, as vLLM serves it)."""

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request) -> Response:
        return await embeddings(ctx, request)

    @app.post("/v1/score")
    @app.post("/score")
    async def score_route(request: Request) -> Response:
        return await score(ctx, request)
