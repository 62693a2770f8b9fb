"""Anthropic's Messages API, `POST /v1/messages`, so the official `anthropic` SDK (and agents built on
it) work against edgellm unchanged: system, messages of text / tool_use / tool_result blocks,
max_tokens, stop_sequences, temperature / top_p / top_k, tools and tool_choice, streaming events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop) and its error
shape. A request is translated into the chat route's and answered by the same engine."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from edgellm.entrypoints.http.gateway import Gateway, streamed_deltas, translated
from edgellm.entrypoints.http.schemas import _Lenient
from edgellm.entrypoints.http.structured import chat_message
from edgellm.generation import Completion

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(_Lenient):
    model: str
    max_tokens: int = Field(ge=1, le=32_768)
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=1000)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: {"type": "json_schema", "schema": ...}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text_of(content, where: str) -> str:
    """A content value (a string or text blocks) as text; other blocks are a 400."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content or []:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{where}: content blocks of type {kind!r} are not supported here (text only)")
        texts.append(block["text"])
    return "".join(texts)


def to_chat(body: MessagesRequest) -> dict:
    """The chat route's body for a Messages request."""
    messages = [] if body.system is None else [{"role": "system", "content": _text_of(body.system, "system")}]
    for i, message in enumerate(body.messages):
        messages += _translated(message, f"messages[{i}]")
    chat = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "stop": body.stop_sequences or None, "stream": body.stream}
    if body.thinking and body.thinking.get("type") not in (None, "disabled"):
        raise ValueError("thinking: extended thinking is not supported by this server")
    output = (body.output_config or {}).get("format")
    if output is not None:
        if not isinstance(output, dict) or output.get("type") != "json_schema" or not isinstance(output.get("schema"), dict):
            raise ValueError("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output["schema"]}}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema", {})}}
                         for t in body.tools]
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body.tool_choice)
    return chat


def _tool_choice(choice: dict | None) -> tuple[Any, bool]:
    choice = choice or {"type": "auto"}
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise ValueError(f"tool_choice: unknown type {kind!r} (auto, any, tool, none)")
    return mapped, parallel


def _translated(message: dict, where: str) -> list[dict]:
    """One Anthropic message as chat messages: tool_use blocks become the assistant's tool calls,
    tool_result blocks tool messages."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise ValueError(f"{where}.role: must be user or assistant, got {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content or []):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text_of(block.get("content", ""), f"{where}.content[{j}].content")})
        else:
            raise ValueError(f"{where}.content[{j}]: blocks of type {kind!r} are not supported here")
    out = results[:]
    if texts or calls or not results:
        out.append({"role": role, "content": "".join(texts) or (None if calls else ""),
                    **({"tool_calls": calls} if calls else {})})
    return out


def stop_reason(done: Completion, finish_reason: str) -> tuple[str, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(done.stop, str):
        return "stop_sequence", done.stop
    return "end_turn", None


def content_blocks(message: dict) -> list[dict]:
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks or [{"type": "text", "text": ""}]


def add_anthropic_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        got = await translated(gateway, request, MessagesRequest.model_validate, to_chat, _error)
        if isinstance(got, JSONResponse):
            return got
        mid = "msg_" + uuid.uuid4().hex[:24]
        if got.body.stream:
            return StreamingResponse(_events(gateway, got.sub, got.first, mid), media_type="text/event-stream")
        message, finish_reason = chat_message(got.done, got.sub.asked)
        reason, sequence = stop_reason(got.done, finish_reason)
        return {"id": mid, "type": "message", "role": "assistant", "model": got.sub.answered,
                "content": content_blocks(message), "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": got.done.timings.prompt_tokens,
                          "output_tokens": got.done.timings.completion_tokens}}


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data | {'type': kind}, ensure_ascii=False)}\n\n"


async def _events(gateway: Gateway, sub, first, mid: str) -> AsyncIterator[str]:
    """The engine's events as Anthropic's stream: a text block, then a tool_use block per call."""
    blocks = _Blocks()
    yield _sse("message_start", {"message": {"id": mid, "type": "message", "role": "assistant",
                                             "model": sub.answered, "content": [], "stop_reason": None,
                                             "stop_sequence": None, "usage": {
                                                 "input_tokens": len(sub.choices[0].handle.prompt_ids),
                                                 "output_tokens": 0}}})
    yield _sse("ping", {})
    try:
        async for delta, end in streamed_deltas(gateway, sub, first):
            if end is None:
                for line in blocks.delta(delta):
                    yield line
                continue
            done, finish_reason = end
            for line in blocks.close():
                yield line
            reason, sequence = stop_reason(done, finish_reason)
            yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": done.timings.completion_tokens}})
            yield _sse("message_stop", {})
    except gateway.api_error as error:
        yield _sse("error", error_body(error.status, error.message))


class _Blocks:
    """Content blocks of a streamed answer: chat deltas (content, tool call starts, their
    arguments) in, Anthropic's block events out."""

    def __init__(self):
        self.index, self.open = -1, None  # the open block's kind: "text" or "tool_use"

    def _start(self, kind: str, block: dict) -> list[str]:
        lines = self.close()
        self.index, self.open = self.index + 1, kind
        return lines + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict) -> list[str]:
        lines = []
        if "content" in delta and delta["content"]:
            if self.open != "text":
                lines += self._start("text", {"type": "text", "text": ""})
            lines.append(_sse("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "text_delta", "text": delta["content"]}}))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                lines += self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                                  "name": call["function"]["name"], "input": {}})
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                lines.append(_sse("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": arguments}}))
        return lines

