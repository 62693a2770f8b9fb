"""Anthropic's Messages API through the official `anthropic` SDK, and OpenAI's Responses API through
the official `openai` SDK, against a real server: text, system / instructions, streaming, tools,
structured output, stop sequences, errors."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.http.conftest import MODEL_ID

QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}
WEATHER_INPUT = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
KEY = "s3cret"


@pytest.fixture
def keyed(server_factory):
    return server_factory(api_key=KEY)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def responses(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_reply(server, system: str | None = None):
    """The chat route's greedy answer to QUESTION (under a system message)."""
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": QUESTION}]
    return responses(server).chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=20)


def chat_answer(server) -> str:
    return chat_reply(server).choices[0].message.content


def test_messages_text_and_stream_are_the_chat_routes_answer(keyed):
    expected = chat_answer(keyed)
    message = claude(keyed).messages.create(model=MODEL_ID, max_tokens=20, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": QUESTION}])
    assert message.content[0].type == "text" and message.content[0].text == expected
    assert message.stop_reason == "end_turn" and message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    with claude(keyed).messages.stream(model=MODEL_ID, max_tokens=20, extra_body=GREEDY,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == expected == final.content[0].text


def test_messages_system_stop_sequences_and_max_tokens(keyed):
    system = "You are a pirate. Answer like one."
    terse = claude(keyed).messages.create(model=MODEL_ID, max_tokens=20, system=system, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": QUESTION}])
    alike = chat_reply(keyed, system)
    assert terse.content[0].text == alike.choices[0].message.content
    assert terse.usage.input_tokens == alike.usage.prompt_tokens != chat_reply(keyed).usage.prompt_tokens  # the system prompt is in it
    cut = claude(keyed).messages.create(model=MODEL_ID, max_tokens=20, stop_sequences=[" France"], extra_body=GREEDY,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", " France") and "France" not in cut.content[0].text
    short = claude(keyed).messages.create(model=MODEL_ID, max_tokens=2, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_messages_tool_use_round_trip(keyed):
    tools = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": WEATHER_INPUT}]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    message = claude(keyed).messages.create(model=MODEL_ID, max_tokens=120, tools=tools, extra_body=GREEDY,
                                            tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=ask)
    assert message.stop_reason == "tool_use"
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.name == "get_weather" and set(use.input) == {"city"}
    with claude(keyed).messages.stream(model=MODEL_ID, max_tokens=120, tools=tools, extra_body=GREEDY, messages=ask,
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        streamed = s.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    then = claude(keyed).messages.create(model=MODEL_ID, max_tokens=30, tools=tools, extra_body=GREEDY, messages=ask + [
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}]}])
    assert then.content[0].type == "text" and then.content[0].text


def test_messages_structured_output(keyed):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    message = claude(keyed).messages.create(model=MODEL_ID, max_tokens=40, extra_body=GREEDY,
                                            output_config={"format": {"type": "json_schema", "schema": schema}},
                                            messages=[{"role": "user", "content": QUESTION}])
    assert set(json.loads(message.content[0].text)) == {"city"}


def test_messages_errors_in_anthropics_shape(keyed):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude(keyed).messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(keyed).messages.create(model=MODEL_ID, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_ID, max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_responses_text_instructions_and_stream(keyed):
    expected = chat_answer(keyed)
    reply = responses(keyed).responses.create(model=MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=20)
    assert reply.output_text == expected and reply.status == "completed" and reply.usage.output_tokens > 0
    stream = responses(keyed).responses.create(model=MODEL_ID, temperature=0, max_output_tokens=20, stream=True,
                                               input=[{"role": "user", "content": [{"type": "input_text",
                                                                                    "text": QUESTION}]}])
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    short = responses(keyed).responses.create(model=MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_function_calls_and_their_output(keyed):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
              "parameters": WEATHER_INPUT}]
    reply = responses(keyed).responses.create(model=MODEL_ID, input="What's the weather in Paris?", tools=tools,
                                              tool_choice="required", parallel_tool_calls=False, temperature=0,
                                              max_output_tokens=120)
    call = reply.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    then = responses(keyed).responses.create(model=MODEL_ID, tools=tools, temperature=0, max_output_tokens=30, input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert then.output_text


def test_responses_structured_output_and_refusals(keyed):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    reply = responses(keyed).responses.create(model=MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=40,
                                              text={"format": {"type": "json_schema", "name": "answer",
                                                               "schema": schema, "strict": True}})
    assert set(json.loads(reply.output_text)) == {"city"}
    for extra in ({"store": True}, {"previous_response_id": "resp_123"}):
        with pytest.raises(openai.BadRequestError):
            responses(keyed).responses.create(model=MODEL_ID, input="x", **extra)
    with pytest.raises(openai.NotFoundError):
        responses(keyed).responses.create(model="gpt-nope", input="x")
