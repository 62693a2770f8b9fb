"""Chat templates as transformers renders them: every real template llama.cpp ships (Qwen2.5,
Qwen3, Llama 3.1/3.2/3.3, Phi-3.5, Gemma 2, SmolLM3, DeepSeek, Mistral, Granite, ... ~70) on
single-turn, system-prompted and multi-turn conversations, with and without the generation
prompt, and — for the templates that take tools — with tool definitions, assistant tool calls
and tool results: byte-identical text, or both refusing the conversation."""
from __future__ import annotations

import json
import re

import pytest

from edgellm.tokenizer.chat.messages import validate_messages
from edgellm.tokenizer.chat.template import ChatTemplate
from edgellm.errors import InvalidRequest, TokenizerError
from edgellm.io.gguf import open_gguf
from edgellm.tokenizer import Tokenizer
from tests.llama_fixtures import models_dir

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
]


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
CALL = {"id": "call0a1b2", "type": "function",  # 9 alphanumerics: Mistral's templates insist
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Use tools when useful."}, {"role": "user", "content": "Weather in Paris?"}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call0a1b2", "name": "get_weather", "content": '{"temperature": 21}'}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call0a1b2", "name": "get_weather", "content": '{"temperature": 21}'},
     {"role": "assistant", "content": "It is 21 °C in Paris."}, {"role": "user", "content": "Thanks!"}],
]


def _templates() -> list:
    return sorted((models_dir() / "templates").glob("*.jinja"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:  # BOS/EOS text for the templates that write them
    return Tokenizer.from_gguf_metadata(open_gguf(models_dir() / "ggml-vocab-llama-bpe.gguf").metadata)


def test_the_fixture_holds_the_templates_of_the_supported_families():
    names = {p.name for p in _templates()}
    for family in ("Qwen2.5-7B-Instruct", "Qwen3-0.6B", "Llama-3.2-3B-Instruct", "Phi-3.5-mini-instruct",
                   "gemma-2-2b-it", "SmolLM3-3B"):
        assert any(family in n for n in names), family
    assert len(names) >= 60


def _differences(tokenizer, templates, conversations, tools=None) -> tuple[list, int]:
    """(template, conversation length, generation prompt) wherever edgellm's text differs from
    transformers' or only one of them refuses; and how many renderings both made."""
    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos = tokenizer.id_to_token(tokenizer.bos_id), tokenizer.id_to_token(tokenizer.eos_id)
    different, rendered = [], 0
    for path in templates:
        ours = ChatTemplate(path.read_text(), tokenizer)
        for conversation in conversations:
            for generation_prompt in (True, False):
                try:  # transformers gets the conversation as edgellm passes it on (null content -> '')
                    expected = render_jinja_template([validate_messages(conversation)], chat_template=path.read_text(), bos_token=bos,
                                                     eos_token=eos, add_generation_prompt=generation_prompt,
                                                     tools=tools)[0][0]
                except Exception:
                    expected = None  # the template refuses this conversation (e.g. Gemma: no system role)
                try:
                    got = ours.render(conversation, add_generation_prompt=generation_prompt, tools=tools)
                except (InvalidRequest, TokenizerError) as e:
                    got = None if expected is None else repr(e)
                if got != expected:
                    different.append((path.name, len(conversation), generation_prompt))
                rendered += got is not None and got == expected
    return different, rendered


def test_every_template_renders_as_transformers_does(tokenizer):
    different, rendered = _differences(tokenizer, _templates(), CONVERSATIONS)
    assert not different
    assert rendered >= 300


def test_tool_definitions_calls_and_results_render_as_transformers_does(tokenizer):
    tool_templates = [p for p in _templates() if ChatTemplate(p.read_text(), tokenizer).takes_tools]
    assert len(tool_templates) >= 25
    # (llama.cpp's copy of SmolLM3's template has no tool section)
    for family in ("Qwen2.5-7B-Instruct", "Qwen3-0.6B", "Llama-3.2-3B-Instruct", "Llama-3.3", "Hermes", "Mistral"):
        assert any(family in p.name for p in tool_templates), family
    different, rendered = _differences(tokenizer, tool_templates, TOOL_CONVERSATIONS, tools=TOOLS)
    assert not different
    assert rendered >= 400  # of 8 renderings each; the rest both refuse (e.g. Kimi's list.append in the sandbox)


def test_tool_call_arguments_may_arrive_as_openais_json_string(tokenizer):
    template = ChatTemplate((models_dir() / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), tokenizer)
    as_string = {**CALL, "function": {**CALL["function"], "arguments": json.dumps(CALL["function"]["arguments"])}}
    conversation = TOOL_CONVERSATIONS[2]
    assert template.render([conversation[0], {**conversation[1], "tool_calls": [as_string]}, conversation[2]],
                           tools=TOOLS) == template.render(conversation, tools=TOOLS)


@pytest.mark.parametrize("bad, names", [
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function"}], "tools[0]"),
    ("get_weather", "tools must be a list"),
])
def test_bad_tool_definitions_are_refused_naming_the_field(tokenizer, bad, names):
    template = ChatTemplate((models_dir() / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), tokenizer)
    with pytest.raises(InvalidRequest, match=re.escape(names)):
        template.render(TOOL_CONVERSATIONS[0], tools=bad)


def test_bad_tool_calls_are_refused_naming_the_field(tokenizer):
    template = ChatTemplate((models_dir() / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), tokenizer)
    broken = {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    with pytest.raises(InvalidRequest, match=re.escape("messages[1].tool_calls[0].function.arguments is not valid JSON")):
        template.render([TOOL_CONVERSATIONS[2][0], {"role": "assistant", "content": None, "tool_calls": [broken]}])
    with pytest.raises(InvalidRequest, match="belongs on an assistant message"):
        template.render([{"role": "user", "content": "x", "tool_calls": [CALL]}])


def test_a_template_without_tools_gets_them_as_plain_turns(tokenizer):
    template = ChatTemplate((models_dir() / "templates" / "google-gemma-2-2b-it.jinja").read_text(), tokenizer)
    assert not template.takes_tools and template.tool_format.name == "generic"
    for conversation in TOOL_CONVERSATIONS:  # Gemma's strict user/model alternation still holds
        text = template.render(conversation, tools=TOOLS)
        assert "<tool_call>" in text and TOOLS[0]["function"]["name"] in text


@pytest.mark.parametrize("name, expected", [("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"),
                                            ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
                                            ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
                                            ("meta-llama-Llama-3.2-3B-Instruct", "llama3"),
                                            ("HuggingFaceTB-SmolLM3-3B", "generic")])
def test_each_template_family_gets_its_tool_format(tokenizer, name, expected):
    template = ChatTemplate((models_dir() / "templates" / f"{name}.jinja").read_text(), tokenizer)
    assert template.tool_format.name == expected

