"""Chat messages -> prompt text, with the model's own Jinja chat template.

Templates come from model files, i.e. from strangers, so they run in Jinja's immutable sandbox,
with the same environment settings and helpers as transformers' apply_chat_template (so output
matches it). Files without a template get a built-in one for their turn format.

BOS: templates such as Gemma's write the BOS token text themselves, so rendered text must be
encoded with add_special_tokens=False; `encode_chat` does that and adds BOS only if missing.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.tokenizer.chat.messages import validate_messages, validate_tools
from edgellm.tokenizer.chat.tool_calls import ToolFormat, inline_tools, tool_format, tools_note
from edgellm.errors import InvalidRequest, TokenizerError
from edgellm.tokenizer import Tokenizer

# Gemma's turn format, for Gemma GGUFs that ship no template: BOS, the system message folded
# into the first user turn, roles strictly alternating from user, assistant called "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set expected = 'user' if loop.index0 is even else 'assistant' -%}"
    "{%- if message['role'] != expected -%}"
    "{{ raise_exception('Gemma expects an optional system message, then user and assistant turns"
    " alternating from user; message ' ~ loop.index ~ ' is ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\n' }}"
    "{{ (ns.prefix if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# ChatML, for files that have its tokens but no template.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


class _TemplateRejected(Exception):
    """raise_exception() inside a template: the conversation, not the template, is at fault."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (marks assistant text for training
    masks in transformers); rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise _TemplateRejected(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would leak into prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks: templates are written against transformers' settings.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template bound to the tokenizer whose special tokens it writes."""

    def __init__(self, source: str, tokenizer: Tokenizer, origin: str = "custom"):
        self.source = source
        self.origin = origin  # "gguf" or "builtin:<format>": where the template came from
        self.tokenizer = tokenizer
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template does not compile: {e.message} (line {e.lineno})") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate:
        """The file's tokenizer.chat_template, else a built-in one matching its special tokens."""
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, tokenizer, origin="gguf")
        if tokenizer.token_to_id("<start_of_turn>") is not None and tokenizer.token_to_id("<end_of_turn>") is not None:
            return cls(GEMMA_TEMPLATE, tokenizer, origin="builtin:gemma")
        if tokenizer.token_to_id("<|im_start|>") is not None and tokenizer.token_to_id("<|im_end|>") is not None:
            return cls(CHATML_TEMPLATE, tokenizer, origin="builtin:chatml")
        raise TokenizerError("the model has no chat template and no known turn tokens")

    def _token_text(self, token_id: int | None) -> str:
        return self.tokenizer.id_to_token(token_id) if token_id is not None else ""

    @property
    def takes_tools(self) -> bool:
        """Whether the template writes tool definitions (Qwen2.5/3, Llama 3.1+, Hermes, SmolLM3, ...)."""
        return "tools" in self.source

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (tokenizer/chat/tool_calls.py); GENERIC: edgellm describes tools itself."""
        return tool_format(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, note: str | None = None) -> str:
        """Prompt text. It may contain BOS text already: encode it with add_special_tokens=False
        (or use encode_chat). `tools`: OpenAI tool definitions; a template that cannot write them
        (or in a format edgellm does not know) gets them, earlier calls and their results as
        plain turns (tokenizer/chat/tool_calls.py). `note`: edgellm's own system text (the shape an answer must
        take), folded into the first user turn where the template refuses system turns."""
        plain, tools = validate_messages(messages), validate_tools(tools)
        if not self.tool_format.native:
            plain, note, tools = inline_tools(plain, self.tool_format), _joined(tools_note(tools), note), None
        if not note:
            return self._render(plain, tools, add_generation_prompt)
        plain = _with_system_note(plain, note)
        try:
            return self._render(plain, tools, add_generation_prompt)
        except InvalidRequest:  # e.g. Gemma 2's template refuses system turns
            return self._render(_system_into_first_user(plain), tools, add_generation_prompt)

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.tokenizer.bos_id),
                eos_token=self._token_text(self.tokenizer.eos_id),
            )
        except _TemplateRejected as e:
            raise InvalidRequest(f"the chat template rejected the conversation: {e}") from None
        except Exception as e:  # a stranger's template may fail any way on a conversation it did not expect
            raise TokenizerError(f"chat template failed to render: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, note: str | None = None) -> list[int]:
        """Prompt token ids, with exactly one BOS when the model wants one."""
        text = self.render(messages, add_generation_prompt, tools, note)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids


def _joined(*notes: str | None) -> str | None:
    return "\n\n".join(n for n in notes if n) or None


def _with_system_note(messages: list[dict], note: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": _joined(messages[0]["content"], note)}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _system_into_first_user(messages: list[dict]) -> list[dict]:
    system, rest = messages[0], list(messages[1:])
    first = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": system["content"]}, *rest]
    rest[first] = {**rest[first], "content": system["content"] + "\n\n" + rest[first]["content"]}
    return rest
