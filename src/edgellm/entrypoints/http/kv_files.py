"""Saved conversations' KV over HTTP (admin routes: the server's API key, refused without one): a
conversation's KV written to a named file in the server's KV folder and put back into the model's
prefix cache later, so the next turn of that conversation skips its prompt. The file carries the
model's identity (a file of another model, precision or weights is refused with 409) and the
conversation itself; names are plain (letters, digits, `._-`): no path, no `..`, no links.

  GET    /admin/kv                  the saved files
  POST   /admin/kv/save             {"name", "messages", "model"?}: compute (or reuse) and save
  POST   /admin/kv/restore          {"name", "model"?}: into the prefix cache; answers the messages
  DELETE /admin/kv/{name}"""
from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
from fastapi import FastAPI
from pydantic import Field

from edgellm.entrypoints.http.schemas import ChatMessage, _Lenient
from edgellm.errors import EdgeLLMError, KVStateMismatch
from edgellm.kv.persist import saved_note

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUFFIX = ".kv"


class KVSave(_Lenient):
    name: str = Field(max_length=64)
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    model: str | None = Field(default=None, max_length=200)


class KVRestore(_Lenient):
    name: str = Field(max_length=64)
    model: str | None = Field(default=None, max_length=200)


def add_kv_routes(app: FastAPI, router, kv_dir: Path, api_key: str | None, error, translate) -> None:
    """`error(status, message, code)` builds the server's APIError; `translate` turns an edgellm
    error into one."""

    def guard() -> None:
        if not api_key:
            raise error(403, "the admin routes need the server's API key: start it with --api-key", "api_key_required")

    def file_of(name: str, exists: bool) -> Path:
        if not NAME.fullmatch(name) or ".." in name:
            raise error(400, f"{name!r} is not a KV name: letters, digits and '._-' (up to 64), no path", "invalid_name")
        path = kv_dir / f"{name}{SUFFIX}"
        if path.is_symlink() or path.parent.resolve() != kv_dir.resolve():
            raise error(400, f"{name!r}: links are not followed", "invalid_name")
        if exists and not path.is_file():
            raise error(404, f"no saved KV named {name!r}", "kv_not_found")
        return path

    async def in_engine(model_name: str | None, work):
        deployment = router.find(model_name or router.names()[0])[0]
        version = await anyio.to_thread.run_sync(router.acquire, deployment.name)
        try:
            return deployment.name, await anyio.to_thread.run_sync(version.service.call, lambda: work(version.model))
        except KVStateMismatch as problem:
            raise error(409, str(problem), "kv_mismatch") from None
        except EdgeLLMError as problem:
            raise translate(problem) from None
        finally:
            router.release(version)

    @app.get("/admin/kv")
    async def saved():
        guard()
        files = sorted(kv_dir.glob(f"*{SUFFIX}")) if kv_dir.is_dir() else []
        return {"object": "list", "data": [{"name": f.name[:-len(SUFFIX)], "bytes": f.stat().st_size}
                                           for f in files if not f.is_symlink()]}

    @app.post("/admin/kv/save")
    async def save(body: KVSave):
        guard()
        path = file_of(body.name, exists=False)
        kv_dir.mkdir(parents=True, exist_ok=True)
        messages = [m.plain() for m in body.messages]
        model, tokens = await in_engine(body.model, lambda m: m.save_prefix(messages, path, note=json.dumps(messages)))
        return {"name": body.name, "model": model, "tokens": tokens, "bytes": path.stat().st_size}

    @app.post("/admin/kv/restore")
    async def restore(body: KVRestore):
        guard()
        path = file_of(body.name, exists=True)
        model, tokens = await in_engine(body.model, lambda m: m.load_prefix(path))
        try:
            messages = json.loads(saved_note(path) or "[]")
        except (ValueError, KVStateMismatch):
            messages = []
        return {"name": body.name, "model": model, "tokens": tokens, "messages": messages}

    @app.delete("/admin/kv/{name}")
    async def remove(name: str):
        guard()
        file_of(name, exists=True).unlink()
        return {"name": name, "deleted": True}
