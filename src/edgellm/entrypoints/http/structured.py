"""Structured output over HTTP: a request's response_format, guided_* extensions (as vLLM
names them) and tools as one constraint, and tool calls in OpenAI's response and stream shapes."""
from __future__ import annotations

from dataclasses import dataclass

from edgellm.tokenizer.chat.messages import validate_tools
from edgellm.generation.constrain import Constraint, InvalidConstraint, any_json, choice, grammar, json_schema, regex
from edgellm.generation.constrain.tools import tool_request
from edgellm.generation import Completion
from edgellm.tokenizer.chat.tool_calls import ToolCallStream, ToolFormat

ONE_OF = "response_format, guided_json, guided_choice, guided_regex and guided_grammar"


@dataclass(frozen=True)
class Structure:
    """What a request asks of its answer's shape."""
    constraint: Constraint | None = None
    tools: list[dict] | None = None  # the tools its prompt shows
    tool_format: ToolFormat | None = None  # set when the answer may be tool calls

    def sampling(self) -> dict:
        return {} if self.constraint is None else {"constraint": self.constraint}


def structure(body, tool_format: ToolFormat) -> Structure:
    """The constraint a request body asks for; InvalidConstraint (a 400) naming what is wrong,
    before anything is queued."""
    asked = _format_constraints(body)
    if len(asked) > 1:
        raise InvalidConstraint("request", f"give at most one of {ONE_OF}")
    tools, tool_constraint = tool_request(validate_tools(getattr(body, "tools", None)),
                                          getattr(body, "tool_choice", None), tool_format,
                                          getattr(body, "parallel_tool_calls", True))
    if tool_constraint is not None and asked:
        raise InvalidConstraint("request", f"tools (unless tool_choice is none) and {ONE_OF} cannot be combined")
    if tool_constraint is not None:
        return Structure(tool_constraint, tools, tool_format)
    return Structure(asked[0] if asked else None, tools)


def _format_constraints(body) -> list[Constraint]:
    asked = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(any_json())
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise InvalidConstraint("response_format", "type json_schema needs a json_schema object")
        asked.append(json_schema(response_format.json_schema.schema_))
    if body.guided_json is not None:
        asked.append(json_schema(body.guided_json))
    if body.guided_choice is not None:
        asked.append(choice(body.guided_choice))
    if body.guided_regex is not None:
        asked.append(regex(body.guided_regex))
    if body.guided_grammar is not None:
        asked.append(grammar(body.guided_grammar))
    return asked


def chat_message(done: Completion, asked: Structure) -> tuple[dict, str]:
    """The assistant message and finish_reason of a finished chat answer."""
    calls = None
    if asked.tool_format is not None and done.constraint_met:
        calls = asked.tool_format.parse(done.text)
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": done.text}, done.finish_reason


class StreamedDeltas:
    """A stream's text as OpenAI deltas: content, or (chat) tool calls (id, type and name
    first, then the arguments) when the answer is calls."""

    def __init__(self, asked: Structure):
        self.calls = ToolCallStream(asked.tool_format) if asked.tool_format is not None else None
        self.called = False

    def push(self, text: str) -> list[dict]:
        if self.calls is None:
            return [{"content": text}] if text else []
        return [self._delta(d) for d in self.calls.push(text)]

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The deltas held back, and the finish_reason to send."""
        deltas = [] if self.calls is None else [self._delta(d) for d in self.calls.finish()]
        return deltas, "tool_calls" if self.called and finish_reason == "stop" else finish_reason

    def _delta(self, d: dict) -> dict:
        if d["kind"] == "content":
            return {"content": d["text"]}
        self.called = True
        if d["kind"] == "call":
            return {"tool_calls": [{"index": d["index"], "id": d["id"], "type": "function",
                                    "function": {"name": d["name"], "arguments": ""}}]}
        return {"tool_calls": [{"index": d["index"], "function": {"arguments": d["text"]}}]}
