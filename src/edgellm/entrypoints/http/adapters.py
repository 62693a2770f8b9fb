"""LoRA adapters on the server: model ids name them ("smollm2-135m:polish", or the base id
with the `edgellm.adapter` extension field), /v1/models lists them beside the base, and
/v1/adapters loads and unloads them while requests run. Loading reads a path on the server's
machine, so these routes need the server's API key: without one they are refused."""
from __future__ import annotations

import anyio
from fastapi import FastAPI
from pydantic import Field

from edgellm.errors import EdgeLLMError, InvalidRequest, ModelNotFound, OutOfMemoryBudget
from edgellm.lora import Adapter
from edgellm.entrypoints.http.schemas import _Lenient


class AdapterLoad(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    path: str = Field(min_length=1, max_length=4096)
    scale: float = Field(default=1.0, ge=0.0, le=100.0)
    model: str | None = Field(default=None, max_length=200)  # which served model (default: the first)


def model_entry(model_id: str, adapter: Adapter | None = None) -> dict:
    """An OpenAI model object; an adapter's names its base (`parent`, as vLLM does)."""
    if adapter is None:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "edgellm"}
    return {"id": f"{model_id}:{adapter.name}", "object": "model", "created": 0, "owned_by": "edgellm",
            "parent": model_id, "root": model_id,
            "edgellm": {"adapter": adapter.name, "path": str(adapter.path), "rank": adapter.rank,
                        "scale": adapter.scale, "bytes": adapter.nbytes, "projections": list(adapter.projections)}}


def pick_adapter(model, model_id: str, named: str | None, extension: str | None) -> tuple[str, Adapter | None]:
    """The id to answer with and the resident adapter a request picks (None: the base): `named`
    from its `model` ("name:adapter"), or the `edgellm.adapter` extension field."""
    if named and extension and named != extension:
        raise InvalidRequest(f"the model names adapter {named!r} but edgellm.adapter asks for {extension!r}")
    name = named or extension
    if not name:
        return model_id, None
    adapter = model.adapters.get(name)  # ModelNotFound names the resident ones
    return f"{model_id}:{name}", adapter


def add_adapter_routes(app: FastAPI, router, api_key: str | None, error) -> None:
    """`error(status, message, code)` builds the server's APIError. Adapters live on a model's
    loaded version (the first model unless the request names another); a version swapped or
    unloaded takes them with it."""

    def guard() -> None:
        if not api_key:
            raise error(403, "loading and unloading adapters needs the server's API key: start it with --api-key",
                        "api_key_required")

    def deployment(name: str | None):
        try:
            return router.find(name or router.names()[0])[0]
        except ModelNotFound as problem:
            raise error(404, str(problem), "model_not_found") from None

    @app.get("/v1/adapters")
    async def list_adapters():
        return {"object": "list", "data": [model_entry(name, a) for name, version in router.loaded()
                                           for a in version.model.adapters]}

    @app.post("/v1/adapters", status_code=201)
    async def load(body: AdapterLoad):
        guard()
        target = deployment(body.model)
        version = await anyio.to_thread.run_sync(router.acquire, target.name)
        try:  # reading the file takes a while: off the event loop, requests keep running
            adapter = await anyio.to_thread.run_sync(lambda: version.model.load_adapter(body.path, body.name, body.scale))
        except OutOfMemoryBudget as problem:  # a sound adapter with no room for it now
            raise error(507, str(problem), "insufficient_memory") from None
        except (EdgeLLMError, OSError) as problem:  # a bad or unreadable file: the caller's to fix
            raise error(400, str(problem), "invalid_adapter") from None
        finally:
            router.release(version)
        return model_entry(target.name, adapter)

    @app.delete("/v1/adapters/{name}")
    async def unload(name: str, model: str | None = None):
        guard()
        target = deployment(model)
        version = target.current
        try:
            if version is None or version.model is None:
                raise ModelNotFound(f"{target.name} is not loaded, so no adapter {name!r} is resident")
            version.model.unload_adapter(name)
        except ModelNotFound as problem:
            raise error(404, str(problem), "adapter_not_found") from None
        return {"id": f"{target.name}:{name}", "object": "model", "deleted": True}
