"""What a conversation may hold before it reaches a chat template: OpenAI-shaped messages
(including assistant tool calls and tool results) and tool definitions.

Only validated fields are passed on, so nothing else in a request can steer a template. Tool
call arguments arrive as a JSON string (OpenAI's wire format) or an object; templates write
them with `tojson`, as transformers expects, so a string is parsed into its object first. The
null content OpenAI sends beside tool calls becomes ''."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from edgellm.errors import InvalidRequest

ROLES = frozenset({"system", "user", "assistant", "tool"})
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """{'role', 'content'} dicts, plus 'tool_calls' on assistant turns and 'tool_call_id' /
    'name' on tool turns; InvalidRequest saying what is wrong otherwise."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return [_validate_message(i, m) for i, m in enumerate(messages)]


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool definitions ({'type': 'function', 'function': {'name', 'description',
    'parameters'}}), or None for no tools."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidRequest("tools must be a list of {'type': 'function', 'function': {...}} objects")
    return [_validate_tool(i, tool) for i, tool in enumerate(tools)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise InvalidRequest(f"{where}.tool_calls belongs on an assistant message, not {role!r}")
    if not isinstance(content, str) and not (calls and content is None):
        raise InvalidRequest(f"{where}.content must be a string, got {type(content).__name__}")
    # OpenAI sends null content beside tool calls; templates such as Qwen3's need a string
    plain: dict[str, Any] = {"role": role, "content": content or ""}
    if calls is not None:
        plain["tool_calls"] = _tool_calls(where, calls)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                plain[key] = _string(f"{where}.{key}", message[key])
    return plain


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)) or not calls:
        raise InvalidRequest(f"{where}.tool_calls must be a non-empty list")
    return [_tool_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    plain: dict[str, Any] = {"type": "function", "function": {
        "name": _name(f"{where}.function.name", function.get("name")),
        "arguments": _arguments(f"{where}.function.arguments", function.get("arguments", {}))}}
    if call.get("id") is not None:
        plain["id"] = _string(f"{where}.id", call["id"])
    return plain


def _arguments(where: str, arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{where} is not valid JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(arguments, Mapping):
        raise InvalidRequest(f"{where} must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


def _validate_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{'name', ...}}}}")
    plain: dict[str, Any] = {"name": _name(f"{where}.function.name", function.get("name"))}
    if function.get("description") is not None:
        plain["description"] = _string(f"{where}.function.description", function["description"])
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object")
        try:  # plain JSON values, nothing callable
            plain["parameters"] = json.loads(json.dumps(parameters))
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"{where}.function.parameters is not JSON: {e}") from None
    return {"type": "function", "function": plain}


def _name(where: str, name: Any) -> str:
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{where} must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    return name


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string, got {type(value).__name__}")
    return value
