"""How a model writes tool calls, and reading them back as OpenAI `tool_calls`.

A chat template that takes tools teaches its model one way of writing a call: Qwen 2.5/3 and
Hermes wrap `{"name": ..., "arguments": {...}}` in <tool_call> tags; Llama 3.x writes
`{"name": ..., "parameters": {...}}` alone. For a template without tools (SmolLM2, Gemma 3)
edgellm describes the tools in a system message and asks for the Hermes form (GENERIC): the
same text a constraint then enforces (generation/constrain/tools.py), so any model can call tools."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes", "llama3", "generic"
    head: str  # before a call's JSON
    args_key: str  # the key holding the arguments object
    tail: str  # after a call's JSON
    separator: str  # between calls
    native: bool  # the template renders tool definitions, calls and results itself

    @property
    def opener(self) -> str:
        """How every call begins: an output starting otherwise is a plain answer."""
        return self.head + '{"name": '

    def call_prefix(self, name: str) -> str:
        return f'{self.opener}{json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '

    def call_suffix(self) -> str:
        return "}" + self.tail

    def call_text(self, name: str, arguments: Any) -> str:
        return self.call_prefix(name) + json.dumps(arguments, ensure_ascii=False) + self.call_suffix()

    def repeat_start(self, text: str) -> int | None:
        """Where the output should end when its last call repeats an earlier one (a small
        model's loop, never a useful call), known once the repeat's arguments are written;
        None otherwise."""
        stream = ToolCallStream(self, unique=False)
        stream.push(text)
        pending, calls = stream.pending(), stream.calls
        if pending is not None and pending in calls:
            return stream.pos
        if len(calls) > 1 and calls[-1] in calls[:-1]:
            return stream.ends[-2]
        return None

    def parse(self, text: str, unique: bool = True) -> list[dict] | None:
        """OpenAI tool calls of an output made of calls only; None for a plain answer (or calls
        not written in this format). `unique`: a call repeating an earlier one is dropped."""
        stream = ToolCallStream(self, unique)
        calls = []
        for delta in stream.push(text) + stream.finish():
            if delta["kind"] == "content":
                return None
            if delta["kind"] == "call":
                calls.append({"id": delta["id"], "type": "function",
                              "function": {"name": delta["name"], "arguments": ""}})
            else:
                calls[delta["index"]]["function"]["arguments"] += delta["text"]
        return calls if calls and stream.complete else None


HERMES = ToolFormat("hermes", "<tool_call>\n", "arguments", "\n</tool_call>", "\n", native=True)
LLAMA3 = ToolFormat("llama3", "", "parameters", "", "; ", native=True)
GENERIC = replace(HERMES, name="generic", native=False)
# A template that writes tools in a format edgellm does not read (Mistral's [TOOL_CALLS], ...):
# it still renders them, as transformers would; calls are read and enforced in Hermes form.
OTHER = replace(HERMES, name="other")


def tool_format(template_source: str) -> ToolFormat:
    """The format a chat template teaches (GENERIC for one without tools: edgellm then
    describes the tools itself)."""
    if "tools" not in template_source:
        return GENERIC
    if "<tool_call>" in template_source:
        return HERMES
    if '"parameters": ' in template_source and '{"name": ' in template_source:
        return LLAMA3
    return OTHER


GENERIC_INSTRUCTIONS = (
    "You may call these tools (each with a JSON schema of its arguments):\n{tools}\n\n"
    "To call a tool, answer with exactly\n"
    "<tool_call>\n{{\"name\": \"<tool name>\", \"arguments\": {{<arguments as JSON>}}}}\n</tool_call>\n"
    "and nothing else; its result comes back in <tool_response> tags. Otherwise answer normally.")


def tools_note(tools: list[dict] | None) -> str | None:
    """The system text that describes `tools` to a model whose template cannot."""
    if not tools:
        return None
    return GENERIC_INSTRUCTIONS.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))


def inline_tools(messages: list[dict], fmt: ToolFormat = GENERIC) -> list[dict]:
    """Messages for a template that cannot render tools: earlier calls as the assistant's
    text, results as user turns (the definitions go in a system note: tools_note)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": fmt.separator.join(calls)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


_NAME = re.compile(r'"((?:[^"\\]|\\.)*)", "')


class ToolCallStream:
    """Reads an output as it streams: plain content, or tool calls as OpenAI streams them (a
    call's id and name, then its arguments). push(text) -> deltas, each
    {"kind": "content", "text"} | {"kind": "call", "index", "id", "name"} |
    {"kind": "arguments", "index", "text"}; finish() releases what was held back. A call is
    released once whole, so one that repeats an earlier call can be left out (`unique`)."""

    def __init__(self, fmt: ToolFormat, unique: bool = True):
        self.fmt, self.unique, self.text, self.mode = fmt, unique, "", "undecided"
        self.pos = 0  # what has been read
        self.index = -1  # the last call released
        self.calls: list[tuple[str, str]] = []  # every whole call read: (name, arguments)
        self.ends: list[int] = []  # where each ends in the text
        self.complete = False  # the text read so far is whole calls (and perhaps a separator)

    def push(self, text: str) -> list[dict]:
        self.text += text
        if self.mode == "undecided":
            if self.fmt.opener.startswith(self.text):
                return []  # could still become a call
            self.mode = "calls" if self.text.startswith(self.fmt.opener) else "content"
        return self._content() if self.mode == "content" else self._calls()

    def finish(self) -> list[dict]:
        if self.mode != "calls":
            self.mode = "content"
            return self._content()
        return []

    def _content(self) -> list[dict]:
        piece, self.pos = self.text[self.pos:], len(self.text)
        return [{"kind": "content", "text": piece}] if piece else []

    def _calls(self) -> list[dict]:
        deltas = []
        while (call := self._call_at(self.pos)) is not None and call[3]:
            name, arguments, _, end = call
            self.pos, self.complete = end, True
            self.calls.append((name, arguments))
            self.ends.append(end)
            if self.unique and (name, arguments) in self.calls[:-1]:
                continue
            self.index += 1
            deltas += [{"kind": "call", "index": self.index, "id": f"call_{uuid.uuid4().hex[:24]}", "name": name},
                       {"kind": "arguments", "index": self.index, "text": arguments}]
        self.complete = call is None and self.text[self.pos:].strip() in ("", self.fmt.separator.strip())
        return deltas

    def pending(self) -> tuple[str, str] | None:
        """The call being written after the whole ones, once its arguments are complete."""
        call = self._call_at(self.pos)
        return None if call is None else call[:2]

    def _call_at(self, start: int) -> tuple[str, str, int, int | None] | None:
        """(name, arguments, where they end, where the call ends: None before its suffix) of
        the call at `start` (after a separator when calls came before), once its arguments
        are complete."""
        if self.calls:
            if not self.text.startswith(self.fmt.separator, start):
                return None
            start += len(self.fmt.separator)
        text, opener = self.text, self.fmt.opener
        if not text.startswith(opener, start):
            return None
        match = _NAME.match(text, start + len(opener))
        key = f'{self.fmt.args_key}": '
        if match is None or not text.startswith(key, match.end()):
            return None
        args_start = match.end() + len(key)
        args_end = _json_end(text, args_start)
        if args_end is None:
            return None
        suffix = self.fmt.call_suffix()
        end = args_end + len(suffix) if text.startswith(suffix, args_end) else None
        return json.loads(f'"{match.group(1)}"'), text[args_start:args_end], args_end, end


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `start` ends; None while it is incomplete."""
    try:
        return json.JSONDecoder().raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return None
