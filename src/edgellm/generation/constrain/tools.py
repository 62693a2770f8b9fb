"""OpenAI `tool_choice` as a grammar: "required" and a named function force calls written in
the model's tool format (tokenizer/chat/tool_calls.py) with arguments valid for each function's schema;
"auto" allows those calls or a plain answer that does not begin like one."""
from __future__ import annotations

import json
from typing import Any

import llguidance

from edgellm.generation.constrain.spec import JSON_OPTIONS, Constraint, InvalidConstraint, checked_grammar, closed_objects
from edgellm.tokenizer.chat.tool_calls import ToolFormat

TOOL_CHOICES = ("none", "auto", "required")
# Calls in one answer: a small model asked for one call may go on calling (the same tool with
# other arguments) until max_tokens and lose them all; four covers real parallel requests.
MAX_CALLS = 4


def tool_request(tools: list[dict] | None, tool_choice: Any, fmt: ToolFormat,
                 parallel: bool = True) -> tuple[list[dict] | None, Constraint | None]:
    """A request's tools -> (the tools its prompt shows, the constraint on its answer).
    tool_choice "none" shows none (the model answers in text)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidConstraint("tool_choice", "there are no tools to choose from")
        return None, None
    if tool_choice == "none":
        return None, None
    return tools, tool_constraint(tools, tool_choice or "auto", fmt, parallel)


def tool_constraint(tools: list[dict], tool_choice: Any, fmt: ToolFormat, parallel: bool = True) -> Constraint | None:
    """The constraint for a request's tools; None when the answer is free ("none", no tools)."""
    if not tools or tool_choice == "none":
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if name not in functions:
            raise InvalidConstraint("tool_choice", f"no tool named {name!r} (tools: {', '.join(functions)})")
        functions, parallel = {name: functions[name]}, False
    elif tool_choice not in ("auto", "required"):
        raise InvalidConstraint("tool_choice", f"must be none, auto, required or a function, got {tool_choice!r}")
    # a separator may end the calls too: a model that writes one after every call is not
    # thereby committed to another
    sep = _lit(fmt.separator)
    more = "".join(f" ({sep} call" for _ in range(MAX_CALLS - 1)) + ")?" * (MAX_CALLS - 1) if parallel else ""
    rules = [f"calls: call{more} {sep}?",
             "call: " + " | ".join(f"call{i}" for i in range(len(functions)))]
    for i, (name, function) in enumerate(functions.items()):
        schema = closed_objects(function.get("parameters") or {"type": "object", "properties": {}})
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        rules.append(f"call{i}: {_lit(fmt.call_prefix(name))} args{i} {_lit(fmt.call_suffix())}")
        rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    if tool_choice == "auto":
        rules = ["start: calls | ANSWER", f"ANSWER: /{_not_starting_with(fmt.opener)}/"] + rules
    else:
        rules = ["start: calls"] + rules
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
    return Constraint("tools", checked_grammar("tools", grammar), cut=fmt.repeat_start)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _not_starting_with(prefix: str) -> str:
    """A regex (Rust syntax) for any text that does not begin with `prefix`: a proper prefix of
    it, or text leaving it at some character."""
    parts = [_escape(prefix[:i]) for i in range(len(prefix))]  # "", "<", "<t", ...
    parts += [_escape(prefix[:i]) + f"[^{_escape(prefix[i])}](?s:.*)" for i in range(len(prefix))]
    return "(" + "|".join(parts) + ")"


def _escape(text: str) -> str:
    # \x{..} for all but letters and digits: in Rust regex "\<" is a word boundary, not "<"
    return "".join(c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):X}}}" for c in text)
