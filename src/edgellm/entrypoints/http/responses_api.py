"""OpenAI's Responses API, `POST /v1/responses`, stateless: text or message input (input_text parts,
function_call and function_call_output items), `instructions`, `max_output_tokens`, sampling, function
tools and tool_choice, `text.format` structured output, and the streamed events the SDK reads
(response.created ... response.output_text.delta ... response.completed). Nothing is stored:
`store: true` and `previous_response_id` are a 400. A request is translated into the chat route's and
answered by the same engine."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from edgellm.entrypoints.http.gateway import Gateway, streamed_deltas, translated
from edgellm.entrypoints.http.schemas import _Lenient
from edgellm.entrypoints.http.structured import chat_message
from edgellm.generation import Completion


class ResponsesRequest(_Lenient):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=32_768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    seed: int | None = None  # extension
    user: str | None = None
    metadata: dict[str, Any] | None = None


def to_chat(body: ResponsesRequest) -> dict:
    if body.store:
        raise ValueError("store: this server keeps no responses (send store: false, or leave it out)")
    if body.previous_response_id:
        raise ValueError("previous_response_id: this server keeps no responses; send the whole conversation as input")
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        messages.append(_message(item, f"input[{i}]", messages))
    chat = {"model": body.model, "messages": [m for m in messages if m is not None],
            "max_tokens": body.max_output_tokens or 256, "temperature": body.temperature, "top_p": body.top_p,
            "stream": body.stream, "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        chat["tools"] = [_function_tool(t, i) for i, t in enumerate(body.tools)]
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    format_ = (body.text or {}).get("format")
    if format_ and format_.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": format_.get("name", "output"),
                                                                          "schema": format_.get("schema", {})}}
    elif format_ and format_.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _function_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: only function tools are supported here, got {tool.get('type')!r}")
    return {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description", ""),
                                             "parameters": tool.get("parameters", {})}}


def _tool_choice(choice) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice or "auto"


def _message(item: dict, where: str, messages: list[dict]) -> dict | None:
    """One input item as a chat message; a function_call item joins the assistant message before it."""
    kind = item.get("type", "message")
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else json.dumps(output)}
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind != "message":
        raise ValueError(f"{where}: items of type {kind!r} are not supported here")
    role = {"developer": "system"}.get(item.get("role"), item.get("role"))
    if role not in ("user", "assistant", "system"):
        raise ValueError(f"{where}.role: must be user, assistant, system or developer, got {item.get('role')!r}")
    return {"role": role, "content": _text(item.get("content"), where)}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: parts of type {kind!r} are not supported here (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


class _Shape:
    """The Response object of one request, filled as the answer comes."""

    def __init__(self, body: ResponsesRequest, model_id: str):
        self.id, self.created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        self.body, self.model_id = body, model_id
        self.message_id = "msg_" + uuid.uuid4().hex[:24]

    def response(self, status: str, output: list[dict], done: Completion | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None if done is None else {
            "input_tokens": done.timings.prompt_tokens, "output_tokens": done.timings.completion_tokens,
            "total_tokens": done.timings.prompt_tokens + done.timings.completion_tokens,
            "input_tokens_details": {"cached_tokens": done.timings.prefix_hit_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.model_id, "output": output, "parallel_tool_calls": b.parallel_tool_calls,
                "temperature": b.temperature, "top_p": b.top_p, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "store": False,
                "metadata": b.metadata or {}, "usage": usage}

    def text_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def call_item(call: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def output(self, message: dict) -> list[dict]:
        calls = [self.call_item(c) for c in message.get("tool_calls") or []]
        return calls if calls else [self.text_item(message.get("content") or "")]


def add_responses_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        got = await translated(gateway, request, ResponsesRequest.model_validate, to_chat, _error)
        if isinstance(got, JSONResponse):
            return got
        shape = _Shape(got.body, got.sub.answered)
        if got.body.stream:
            return StreamingResponse(_events(gateway, got.sub, shape, got.first), media_type="text/event-stream")
        message, finish_reason = chat_message(got.done, got.sub.asked)
        return shape.response(_status(finish_reason), shape.output(message), got.done)


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason in ("length", "timeout") else "completed"


async def _events(gateway: Gateway, sub, shape: _Shape, first) -> AsyncIterator[str]:
    seq = [0]

    def sse(kind: str, data: dict) -> str:
        seq[0] += 1
        return f"event: {kind}\ndata: {json.dumps(data | {'type': kind, 'sequence_number': seq[0] - 1})}\n\n"

    stream = _Output(shape, sse)
    yield sse("response.created", {"response": shape.response("in_progress", [])})
    yield sse("response.in_progress", {"response": shape.response("in_progress", [])})
    try:
        async for delta, end in streamed_deltas(gateway, sub, first):
            if end is None:
                for line in stream.delta(delta):
                    yield line
                continue
            done, finish_reason = end
            for line in stream.close():
                yield line
            status = _status(finish_reason)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield sse(kind, {"response": shape.response(status, stream.items, done)})
    except gateway.api_error as error:
        yield sse("error", {"code": error.code, "message": error.message, "param": None})


class _Output:
    """Output items of a streamed answer: a message's text deltas, or function calls' argument deltas."""

    def __init__(self, shape: _Shape, sse):
        self.shape, self.sse, self.items = shape, sse, []
        self.open: dict | None = None  # the item being written
        self.text = ""

    def _add(self, item: dict) -> list[str]:
        lines = self.close()
        self.open = item
        index = len(self.items)
        lines.append(self.sse("response.output_item.added", {"output_index": index, "item": item | {"status": "in_progress"}}))
        if item["type"] == "message":
            lines.append(self.sse("response.content_part.added", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
        return lines

    def delta(self, delta: dict) -> list[str]:
        lines = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                self.text = ""
                lines += self._add(self.shape.text_item("", "in_progress"))
            self.text += delta["content"]
            lines.append(self.sse("response.output_text.delta", {"item_id": self.open["id"], "output_index": len(self.items),
                                                                 "content_index": 0, "delta": delta["content"]}))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                lines += self._add(self.shape.call_item({"id": call["id"], "function": {
                    "name": call["function"]["name"], "arguments": ""}}))
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                self.open["arguments"] += arguments
                lines.append(self.sse("response.function_call_arguments.delta", {
                    "item_id": self.open["id"], "output_index": len(self.items), "delta": arguments}))
        return lines

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item, index, lines = self.open, len(self.items), []
        if item["type"] == "message":
            item = self.shape.text_item(self.text)
            part = item["content"][0]
            lines.append(self.sse("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                                "content_index": 0, "text": self.text}))
            lines.append(self.sse("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                                 "content_index": 0, "part": part}))
        else:
            lines.append(self.sse("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "arguments": item["arguments"]}))
        lines.append(self.sse("response.output_item.done", {"output_index": index, "item": item}))
        self.items.append(item)
        self.open = None
        return lines
