"""Structured output through the server, driven by the official openai client: parse() with a
pydantic model on 50 varied prompts, tools round trips (plain and streamed), guided_*
extensions, bad constraints as 400s, and batched requests each under its own grammar."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

import edgellm
from tests.http.conftest import MODEL_ID, RunningServer

BATCH = 4  # concurrent requests of the parse tests

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


class Contact(BaseModel):
    name: str = Field(max_length=40)
    city: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)


class Ticket(BaseModel):
    intent: Literal["billing", "bug", "feature", "other"]
    urgent: bool
    summary: str = Field(max_length=80)


class Order(BaseModel):  # bounded strings: a small model may repeat inside an unbounded one till max_tokens
    items: list[Annotated[str, Field(max_length=30)]] = Field(max_length=4)
    total: float = Field(ge=0)


PEOPLE = [("Ada", "London", 36), ("Bob", "Paris", 51), ("Chen", "Shanghai", 28), ("Dara", "Dublin", 44),
          ("Eve", "Oslo", 19), ("Femi", "Lagos", 33), ("Gus", "Lima", 67), ("Hana", "Kyoto", 25),
          ("Ivan", "Kyiv", 40), ("Jo", "Austin", 58)]
TICKETS = ["I was charged twice for my subscription!", "The app crashes when I open settings.",
           "Could you add a dark mode?", "What are your opening hours?", "My invoice shows the wrong VAT number.",
           "Login fails with error 500 since this morning, urgent!", "Please support exporting to CSV.",
           "Thanks for the quick help yesterday.", "Refund my last payment please.", "The search button does nothing."]
ORDERS = ["two apples and a pear for 3.50", "one coffee, 2.20", "bread, milk and eggs, 7 dollars",
          "a book for 12.99", "three pens and a notebook at 6.40", "nothing yet, total zero",
          "pizza and cola for 15", "a lamp, 23.50", "socks and a hat, 18", "tea for 1.80"]


def _prompts() -> list[tuple[type[BaseModel], str]]:
    contacts = [f"{n} is {a} years old and lives in {c}. Extract the contact." for n, c, a in PEOPLE]
    contacts += [f"Contact card: name {n}, age {a}, based in {c}." for n, c, a in PEOPLE]
    tickets = [f"Turn this message into a support ticket: {t}" for t in TICKETS]
    tickets += [f"Customer wrote: '{t}' Classify it." for t in TICKETS]
    orders = [f"Record this order: {o}" for o in ORDERS]
    return [(Contact, p) for p in contacts] + [(Ticket, p) for p in tickets] + [(Order, p) for p in orders]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _parse_all(server, model_id: str, every: int = 1) -> None:
    """Four requests at a time: the server batches them, each row under its own grammar."""
    client, prompts = _client(server), _prompts()
    assert len(prompts) == 50

    def parse(schema: type[BaseModel], prompt: str) -> None:
        done = client.chat.completions.parse(model=model_id, messages=[{"role": "user", "content": prompt}],
                                             response_format=schema, max_tokens=120, temperature=0)
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "stop", (prompt, message.content)
        assert isinstance(message.parsed, schema), (prompt, message.content)

    with ThreadPoolExecutor(max_workers=BATCH) as pool:
        for done in [pool.submit(parse, schema, prompt) for schema, prompt in prompts[::every]]:
            done.result()  # raises the request's assertion


def test_parse_gives_a_valid_object_on_fifty_varied_prompts(server_factory):
    _parse_all(server_factory(max_batch=BATCH, queue_limit=2 * BATCH), MODEL_ID)


@pytest.mark.slow
def test_gemma_parses_varied_prompts_too(gemma3_path):
    """Every other prompt of the fifty (all three schemas), four at a time (13 s; one at a time 29 s):
    the whole set passed 50/50 when measured for docs/structured-output.md."""
    with edgellm.load(gemma3_path) as gemma:
        server = RunningServer(gemma, timeout_s=120, max_batch=BATCH, queue_limit=2 * BATCH)
        try:
            _parse_all(server, "smollm2-135m", every=2)  # the fixture's id names whatever model it serves
        finally:
            server.stop()


def test_tools_round_trip(server):
    client = _client(server)
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    done = client.chat.completions.create(model=MODEL_ID, messages=ask, tools=[WEATHER], tool_choice="required",
                                          max_tokens=200, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments) for c in calls)
    conversation = ask + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'} for c in calls]
    answer = client.chat.completions.create(model=MODEL_ID, messages=conversation, tools=[WEATHER],
                                            tool_choice="none", max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_streamed_tool_calls_arrive_as_openai_deltas(server):
    client = _client(server)
    ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
    whole = client.chat.completions.create(model=MODEL_ID, messages=ask, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, temperature=0).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=ask, tools=[WEATHER], tool_choice="required",
                                                max_tokens=200, temperature=0, stream=True):
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        assert not delta.content
        for piece in delta.tool_calls or []:
            if piece.id:
                assert piece.type == "function" and piece.function.name and piece.function.arguments == ""
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                calls[piece.index]["arguments"] += piece.function.arguments
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                                      for c in whole]


def test_required_always_calls_and_auto_may_answer(server):
    client = _client(server)
    for question in ["Tell me a joke.", "What's 2 + 2?", "Weather in Rome and in Milan?", "Hi!"]:
        done = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                              tools=[WEATHER], tool_choice="required", max_tokens=200,
                                              temperature=0.8, seed=7)
        assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.tool_calls, question
    done = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], max_tokens=30, temperature=0)
    message = done.choices[0].message
    assert message.tool_calls or (message.content and not message.content.startswith("<tool_call>"))


def test_guided_extensions_and_json_object(server):
    client = _client(server)
    ask = [{"role": "user", "content": "Is Paris in France?"}]
    done = client.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=10,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].message.content in ("yes", "no")
    done = client.completions.create(model=MODEL_ID, prompt="The year the Eiffel Tower opened:", max_tokens=10,
                                     extra_body={"guided_regex": "[12][0-9]{3}"})
    assert re.fullmatch("[12][0-9]{3}", done.choices[0].text)
    done = client.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=10,
                                          extra_body={"guided_grammar": 'root ::= ("Yes" | "No") "!"'})
    assert done.choices[0].message.content in ("Yes!", "No!")
    done = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                          response_format={"type": "json_object"}, max_tokens=150, temperature=0)
    report = done.model_extra["edgellm"]
    if done.choices[0].finish_reason == "stop":
        assert report["constraint_met"] and isinstance(json.loads(done.choices[0].message.content), dict)
    else:  # cut by max_tokens: flagged, never passed off as valid
        assert report["constraint_met"] is False


@pytest.mark.parametrize("extra, names", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "Invalid type: nope"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_grammar": "start: missing"}, "unknown name"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "at most one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool named 'nope'"),
    ({"tool_choice": "required"}, "no tools to choose from"),
])
def test_bad_constraints_are_400_naming_the_problem_and_the_server_lives_on(server, extra, names):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert names in response.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", json={**body, **{k: None for k in extra}}, timeout=60)
    assert ok.status_code == 200


def test_batched_requests_each_keep_their_own_grammar(server_factory):
    server = server_factory(max_batch=4, queue_limit=8)
    client = _client(server)
    asks = [({"guided_choice": ["red", "green", "blue"]}, "Name a colour."),
            ({"guided_regex": "[0-9]{2,4}"}, "How tall is a giraffe in cm?"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": Contact.model_json_schema()}}},
             "Ada is 36 and lives in London. Extract the contact."),
            ({}, "Say something nice.")]

    def ask(extra, prompt):
        return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=60, temperature=0, extra_body=extra).choices[0].message.content

    alone = [ask(*a) for a in asks]
    together = [None] * len(asks)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(*asks[i]))) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert alone[0] in ("red", "green", "blue") and re.fullmatch("[0-9]{2,4}", alone[1])
    Contact.model_validate_json(alone[2])


def test_a_timed_out_or_stopped_constrained_answer_is_flagged_not_valid(server_factory):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Describe Paris in detail as JSON."}],
            "response_format": {"type": "json_object"}, "max_tokens": 2000, "temperature": 0}
    hurried = server_factory(timeout_s=0.4)
    done = httpx.post(hurried.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert done["choices"][0]["finish_reason"] == "timeout" and done["edgellm"]["constraint_met"] is False
    # the stop string on a server with time to reach it (a cold process may need 0.5 s for the token table)
    server = server_factory()
    stopped = httpx.post(server.url + "/v1/chat/completions", json={**body, "stop": ['"'], "max_tokens": 50},
                         timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["edgellm"]["constraint_met"] is False
