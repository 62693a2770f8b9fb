"""`POST /tokenize` and `POST /detokenize` in llama.cpp server's shapes, for a served model (the
first unless the body names one): what clients use to count tokens, build logit_bias maps and check
prompts against the context."""
from __future__ import annotations

import anyio
from fastapi import FastAPI
from pydantic import Field

from edgellm.entrypoints.http.schemas import _Lenient

MAX_TOKENS = 1_000_000


class Tokenize(_Lenient):
    content: str = Field(max_length=2_000_000)
    add_special: bool = False  # the tokenizer's BOS where it adds one
    with_pieces: bool = False
    model: str | None = Field(default=None, max_length=200)


class Detokenize(_Lenient):
    tokens: list[int] = Field(max_length=MAX_TOKENS)
    model: str | None = Field(default=None, max_length=200)


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (as llama.cpp answers)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def add_token_routes(app: FastAPI, router, error) -> None:
    """`error(status, message, code)` builds the server's APIError."""

    async def with_model(name: str | None, work):
        deployment = router.find(name or router.names()[0])[0]
        version = await anyio.to_thread.run_sync(router.acquire, deployment.name)
        try:
            return await anyio.to_thread.run_sync(work, version.model)
        finally:
            router.release(version)

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        def run(model):
            ids = model.tokenizer.encode(body.content, add_special_tokens=body.add_special)
            if not body.with_pieces:
                return {"tokens": ids}
            return {"tokens": [{"id": i, "piece": _piece(model.tokenizer.token_bytes(i))} for i in ids]}
        return await with_model(body.model, run)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize):
        def run(model):
            vocab = model.tokenizer.vocab_size
            bad = next((i for i in body.tokens if not 0 <= i < vocab), None)
            if bad is not None:
                raise error(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "invalid_token")
            return {"content": model.tokenizer.decode(body.tokens)}
        return await with_model(body.model, run)
