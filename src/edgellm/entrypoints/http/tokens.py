"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` for a served model (the first unless
the request names one), in llama.cpp server's shapes and vLLM's (`prompt` / `add_special_tokens`, which
lm-evaluation-harness's remote tokenizer sends): what clients use to count tokens, build logit_bias
maps, check prompts against the context, and score choices with the server's own tokenizer."""
from __future__ import annotations

import anyio
from fastapi import FastAPI
from pydantic import Field, model_validator

from edgellm.entrypoints.http.schemas import _Lenient

MAX_TOKENS = 1_000_000


class Tokenize(_Lenient):
    content: str | None = Field(default=None, max_length=2_000_000)
    prompt: str | None = Field(default=None, max_length=2_000_000)  # vLLM's name for content
    add_special: bool = False  # the tokenizer's BOS where it adds one
    add_special_tokens: bool | None = None  # vLLM's name for add_special
    with_pieces: bool = False
    model: str | None = Field(default=None, max_length=200)

    @model_validator(mode="after")
    def _one_text(self):
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as content (or prompt), once")
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt

    @property
    def special(self) -> bool:
        return self.add_special if self.add_special_tokens is None else self.add_special_tokens


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
            ids = model.tokenizer.encode(body.text, add_special_tokens=body.special)
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
            text = model.tokenizer.decode(body.tokens)
            return {"content": text, "prompt": text}  # llama.cpp's key and vLLM's
        return await with_model(body.model, run)

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None):
        def run(served):
            tokenizer = served.tokenizer
            name = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
            eos = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
            return {"eos_token": name(eos), "bos_token": name(tokenizer.bos_id), "pad_token": None,
                    "chat_template": served.template.source, "model_max_length": served.context_length,
                    "vocab_size": tokenizer.vocab_size}
        return await with_model(model, run)
