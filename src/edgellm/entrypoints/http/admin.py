"""The server's admin routes: which version of each model it serves, and hot swaps. A swap loads
what the server's machine holds under a name or path, so these routes need the server's API key
and are refused without one.

  GET  /admin/models                 each served model: what it loads, loaded or not, the version before
  POST /admin/models/{id}/swap       {"model": "NAME:TAG" or a path}: load it beside, check it, switch
  POST /admin/models/{id}/rollback   back to the version the last swap replaced"""
from __future__ import annotations

import anyio
from fastapi import FastAPI
from pydantic import Field

from edgellm.errors import EdgeLLMError, ModelNotFound, OutOfMemoryBudget
from edgellm.entrypoints.http.schemas import _Lenient
from edgellm.serving.router import Router, SwapFailed


class Swap(_Lenient):
    model: str = Field(min_length=1, max_length=4096)


def add_admin_routes(app: FastAPI, router: Router, api_key: str | None, error, metrics) -> None:
    """`error(status, message, code)` builds the server's APIError."""

    def guard(name: str | None = None) -> None:
        if not api_key:
            raise error(403, "the admin routes need the server's API key: start it with --api-key", "api_key_required")
        if name is not None and name not in router.deployments:
            raise error(404, f"this server serves no model {name!r}", "model_not_found")

    def entry(name: str) -> dict:
        d = router.deployments[name]
        loaded = d.current is not None and d.current.service is not None
        state = "loaded" if loaded else ("loading" if d.current is not None and d.current.error is None else "unloaded")
        return {"id": name, "model": d.ref, "state": state, "previous": d.previous,
                "load_s": round(d.current.load_s, 3) if loaded else None}

    async def run(name: str, swap) -> dict:
        try:
            done = await anyio.to_thread.run_sync(swap)
        except OutOfMemoryBudget as problem:
            metrics.swaps.labels("no_room").inc()
            raise error(507, str(problem), "insufficient_memory") from None
        except (SwapFailed, ModelNotFound) as problem:
            metrics.swaps.labels("failed").inc()
            raise error(422, f"{problem}; {name} still serves {router.deployments[name].ref}", "swap_failed") from None
        except EdgeLLMError as problem:  # no previous version, a bad name
            metrics.swaps.labels("failed").inc()
            raise error(400, str(problem), "invalid_swap") from None
        metrics.swaps.labels("done").inc()
        return done

    @app.get("/admin/models")
    async def list_models():
        guard()
        return {"object": "list", "data": [entry(name) for name in router.names()]}

    @app.post("/admin/models/{name:path}/swap")
    async def swap(name: str, body: Swap):
        guard(name)
        return await run(name, lambda: router.swap(name, body.model))

    @app.post("/admin/models/{name:path}/rollback")
    async def rollback(name: str):
        guard(name)
        return await run(name, lambda: router.rollback(name))
