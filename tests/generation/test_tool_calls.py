"""Tool calls read back from text (every split of a stream gives the same deltas), written by
the model under tool_choice (required / a named function always call; auto may answer), and
fed back through the chat template."""
from __future__ import annotations

import json

import pytest

import edgellm
from edgellm.generation.constrain import InvalidConstraint
from edgellm.generation.constrain.tools import tool_request
from edgellm.tokenizer.chat.tool_calls import GENERIC, HERMES, LLAMA3, ToolCallStream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_calls_parse_whole_and_stream_alike_at_every_split(fmt):
    text = fmt.separator.join([fmt.call_text("get_weather", {"city": "Paris"}), fmt.call_text("add", {"a": 2, "b": 3}),
                               fmt.call_text("get_weather", {"city": "Paris"})])  # the repeat is left out
    calls = fmt.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    for cut in range(len(text) + 1):
        stream = ToolCallStream(fmt)
        deltas = stream.push(text[:cut]) + stream.push(text[cut:]) + stream.finish()
        assert [(d["kind"], d.get("name"), d.get("text")) for d in deltas] == [
            ("call", "get_weather", None), ("arguments", None, '{"city": "Paris"}'),
            ("call", "add", None), ("arguments", None, '{"a": 2, "b": 3}')]


def test_plain_text_is_content_and_a_cut_call_is_not_a_call():
    assert HERMES.parse("The weather is fine.") is None
    assert HERMES.parse(HERMES.call_text("add", {"a": 1, "b": 2})[:-3]) is None
    stream = ToolCallStream(HERMES)
    assert stream.push("<tool") == []  # may still become a call
    assert stream.push(" is a tag") == [{"kind": "content", "text": "<tool is a tag"}]


def test_bad_tool_choices_are_typed_errors():
    with pytest.raises(InvalidConstraint, match="no tool named 'nope'"):
        tool_request([WEATHER], {"type": "function", "function": {"name": "nope"}}, GENERIC)
    with pytest.raises(InvalidConstraint, match="no tools to choose from"):
        tool_request(None, "required", GENERIC)
    assert tool_request([WEATHER], "none", GENERIC) == (None, None)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with edgellm.load(smollm2_path) as model:
        yield model


def test_required_and_named_tool_choices_always_call(smollm2):
    questions = ["What's the weather in Paris?", "Add 2 and 40.", "Tell me a joke.", "How warm is Oslo in fahrenheit?"]
    for question in questions:
        done = smollm2.chat([{"role": "user", "content": question}], tools=[WEATHER, ADD], tool_choice="required",
                            max_tokens=200)
        assert done.finish_reason == "tool_calls" and done.tool_calls, question
        for call in done.tool_calls:
            assert call["function"]["name"] in ("get_weather", "add")
            json.loads(call["function"]["arguments"])
    done = smollm2.chat(ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                        max_tokens=120)
    (call,) = done.tool_calls
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "add" and set(arguments) == {"a", "b"}
    assert all(isinstance(v, int) for v in arguments.values())


def test_a_tool_round_trip_ends_in_an_answer(smollm2):
    done = smollm2.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
    call = done.tool_calls[0]
    conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": done.tool_calls},
                          {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    answer = smollm2.chat(conversation, tools=[WEATHER], tool_choice="none", max_tokens=40)
    assert answer.tool_calls is None and answer.text and answer.finish_reason in ("stop", "length")
    auto = smollm2.chat(conversation, tools=[WEATHER], max_tokens=60)
    assert auto.tool_calls or not auto.text.startswith(GENERIC.opener)  # a call, or an answer that is not one


@pytest.mark.parametrize("template, expected", [("Qwen-Qwen2.5-7B-Instruct", "hermes"),
                                                ("meta-llama-Llama-3.2-3B-Instruct", "llama3")])
def test_a_template_with_its_own_tool_format_renders_tools_and_gets_calls_in_it(smollm2, template, expected):
    from edgellm.tokenizer.chat.template import ChatTemplate
    from tests.llama_fixtures import models_dir

    own = smollm2.template
    smollm2.template = ChatTemplate((models_dir() / "templates" / f"{template}.jinja").read_text(), smollm2.tokenizer)
    try:
        fmt = smollm2.template.tool_format
        assert fmt.name == expected and fmt.native
        prompt = smollm2.template.render(ASK, tools=[WEATHER])
        assert "get_weather" in prompt and "You may call these tools" not in prompt  # the template's own words
        done = smollm2.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
        assert done.finish_reason == "tool_calls" and done.text.startswith(fmt.opener)
        assert all(c["function"]["name"] == "get_weather" for c in done.tool_calls)
        conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": done.tool_calls[:1]},
                              {"role": "tool", "tool_call_id": done.tool_calls[0]["id"], "content": "21 C"}]
        assert smollm2.template.render(conversation, tools=[WEATHER])  # fed back through the template
    finally:
        smollm2.template = own
