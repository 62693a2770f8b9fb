"""`POST /v1/embeddings` in OpenAI's shape: a text, texts, token ids or lists of them, one vector each
(the model's last hidden states after its final norm, pooled as the GGUF says or by mean, then
L2-normalized: `Model.embed`); `dimensions` keeps the first N and normalizes again; `encoding_format`
float or base64 (little-endian float32). The work runs in the model's engine thread, between the
steps of its generations."""
from __future__ import annotations

import base64
from typing import Literal

import anyio
import numpy as np
from fastapi import FastAPI
from pydantic import Field, field_validator

from edgellm.entrypoints.http.schemas import _Lenient, clean_text

MAX_INPUTS = 256


class EmbeddingsRequest(_Lenient):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not 1 <= len(inputs) <= MAX_INPUTS:
            raise ValueError(f"between 1 and {MAX_INPUTS} inputs")
        if any(not one for one in inputs):
            raise ValueError("an input is empty")
        return [clean_text(one) if isinstance(one, str) else one for one in inputs]


def add_embedding_routes(app: FastAPI, router, translate, error) -> None:
    """`translate(edgellm error)` -> the server's APIError; `error(status, message, code)` builds one."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest):
        try:
            deployment, _ = router.find(body.model)
            version = await anyio.to_thread.run_sync(router.acquire, deployment.name)
        except Exception as problem:  # noqa: BLE001 - the server's translation decides the status
            raise translate(problem) from None
        try:
            model = version.model
            vectors, tokens = await anyio.to_thread.run_sync(version.service.call,
                                                             lambda: model.embed(body.input))
        except Exception as problem:  # noqa: BLE001
            raise translate(problem) from None
        finally:
            router.release(version)
        if body.dimensions is not None:
            if body.dimensions > vectors.shape[1]:
                raise error(400, f"dimensions: this model's vectors have {vectors.shape[1]}", None)
            vectors = vectors[:, :body.dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": deployment.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
