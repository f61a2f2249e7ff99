"""LoRA adapters over HTTP: `/v1/models` cards, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (vLLM's routes and bodies).

Both routes are behind the API key, as every route but `/health` (`middleware.py`), and
answer only with `--enable-lora` (else 400) and `--allow-runtime-lora-updating` (else 403);
a bad body is a 400. A load checks the folder on an offload thread (`LoraRegistry.check`
reads files: `adapter_config.json`, the safetensors header, the model's config.json) and
refuses with the reason (400); a name in use is a 400. A loaded adapter gets the next id
and every engine's scheduler is told (`AddLora`). An unload forgets the name at once (new
requests naming it get 404) and tells every scheduler (`RemoveLora`), which lets the
adapter's requests in flight finish before the workers drop it; an unknown name is a 404.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from subway.frontend.errors import APIError
from subway.frontend.inputs import R, parse
from subway.frontend.lora import LoraError, LoraRegistry
from subway.frontend.pipeline import ServingContext
from subway.frontend.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from subway.frontend.responses import ModelCard
from subway.ipc.messages import AddLora, RemoveLora

log = logging.getLogger("subway.frontend")


def model_cards(lora: LoraRegistry, max_model_len: int | None) -> list[ModelCard]:
    """`/v1/models`: the base model, then each adapter (its folder as `root`, the base as
    `parent`), as vLLM lists them."""
    base = lora.base_name
    cards = [ModelCard(id=base, max_model_len=max_model_len)]
    for adapter, info in lora.adapters():
        cards.append(
            ModelCard(id=adapter.name, root=info.path, parent=base, max_model_len=max_model_len)
        )
    return cards


def check_runtime_updates(lora: LoraRegistry) -> None:
    """The routes answer only on a server that serves adapters and allows runtime changes."""
    if not lora.enabled:
        raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)")
    if not lora.runtime_updates:
        raise APIError(
            403,
            "loading and unloading LoRA adapters at runtime is off on this server (start it "
            "with --allow-runtime-lora-updating)",
        )


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`."""
    lora = ctx.lora
    assert lora is not None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        check_runtime_updates(lora)
        req = await _parse(ctx, LoadLoraAdapterRequest, request)
        name = req.lora_name
        param = "lora_name"
        try:
            lora.check_name(name)  # at once: a name in use costs no file read
            param = "lora_path"
            info = await ctx.offload.run(
                lora.check, name, req.lora_path, what="checking the adapter", param=param
            )
            param = "lora_name"
            adapter = lora.register(info)  # (its name may have been taken meanwhile)
        except LoraError as e:
            raise APIError(400, f"cannot load adapter {name}: {e}", param) from None
        ctx.engine.send_lora(AddLora(adapter))
        if ctx.metrics is not None:
            ctx.metrics.adapter_added(name)
        log.info("LoRA adapter %s loaded (id %d, rank %d, %s)", name, adapter.lora_id, info.rank,
                 ", ".join(info.targets))  # fmt: skip
        body = {"status": "ok", "message": f"adapter {name} loaded", "id": adapter.lora_id}
        return JSONResponse(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        check_runtime_updates(lora)
        req = await _parse(ctx, UnloadLoraAdapterRequest, request)
        lora_id = lora.remove(req.lora_name)
        ctx.engine.send_lora(RemoveLora(lora_id))
        if ctx.metrics is not None:
            ctx.metrics.adapter_removed(req.lora_name)
        log.info("LoRA adapter %s unloaded (id %d)", req.lora_name, lora_id)
        message = f"adapter {req.lora_name} unloaded (its requests in flight finish first)"
        return JSONResponse({"status": "ok", "message": message, "id": lora_id})


async def _parse(ctx: ServingContext, model: type[R], request: Request) -> R:
    body = await request.body()
    return await ctx.offload.run(parse, model, body, what="parsing the request body")
