"""Constrained generation on the real models: every output matches its JSON schema, choice,
regex or grammar, ends (EOS) only where the grammar may end, is the same with and without the
prefix cache and under speculative decoding, and bad constraints are typed errors before any
generation."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from pydantic import BaseModel, Field

import edgellm
from edgellm.generation import constrain
from edgellm.generation.constrain import InvalidConstraint
from edgellm.kv import KVConfig


class Ticket(BaseModel):
    name: str = Field(max_length=30)
    intent: str = Field(pattern="^(billing|bug|other)$")
    priority: int = Field(ge=1, le=5)
    tags: list[str] = Field(max_length=3)


TICKET_PROMPT = [{"role": "user", "content": "I'm Bob and my printer is broken again. "
                  "Write the support ticket as JSON with name, intent, priority and tags."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with edgellm.load(smollm2_path) as model:
        yield model


@pytest.mark.parametrize("make, problem", [
    (lambda: constrain.json_schema({"type": "foo"}), "Invalid type: foo"),
    (lambda: constrain.json_schema({"type": "object", "if": {}}), "Unimplemented keys"),
    (lambda: constrain.json_schema({"type": "string", "minLength": 3, "maxLength": 2}), "minLength (3)"),
    (lambda: constrain.json_schema("{not json"), "not JSON"),
    (lambda: constrain.regex("a(b"), "unclosed group"),
    (lambda: constrain.grammar("start: undefined_rule"), "unknown name"),
    (lambda: constrain.choice([]), "non-empty list"),
    (lambda: constrain.choice("yes"), "non-empty list"),
])
def test_an_invalid_constraint_is_a_typed_error_naming_the_problem(make, problem):
    with pytest.raises(InvalidConstraint, match=re.escape(problem)):
        make()


def test_a_pydantic_schema_gives_a_parsed_object(smollm2):
    done = smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=100)
    assert done.finish_reason == "stop" and done.constraint_met
    assert isinstance(done.parsed, Ticket)
    assert Ticket.model_validate_json(done.text) == done.parsed
    assert set(json.loads(done.text)) <= {"name", "intent", "priority", "tags"}  # strict: no extra keys


def test_a_choice_is_exactly_one_label_and_ends_there(smollm2):
    labels = ["billing", "bug report", "other"]
    for text in ("I was charged twice this month.", "The app crashes when I click save.", "Hello!"):
        done = smollm2.chat([{"role": "user", "content": f"Classify: {text}"}], max_tokens=20,
                            constraint=constrain.choice(labels))
        assert done.text in labels and done.finish_reason == "stop" and done.stop in smollm2.tokenizer.eos_ids


def test_a_regex_holds_under_sampling_with_any_seed(smollm2):
    pattern = r"[0-9]{3}-[0-9]{4}"
    for seed in range(8):
        done = smollm2.generate("Call me at", constraint=constrain.regex(pattern), temperature=1.0, seed=seed,
                                max_tokens=20)
        assert re.fullmatch(pattern, done.text) and done.constraint_met


def test_a_gbnf_grammar_and_any_json(smollm2):
    done = smollm2.chat([{"role": "user", "content": "Is the sky blue?"}],
                        constraint=constrain.grammar('root ::= ("yes" | "no") "."'), max_tokens=10)
    assert done.text in ("yes.", "no.")
    done = smollm2.chat(TICKET_PROMPT, constraint=constrain.any_json(), max_tokens=200)
    assert done.constraint_met == (done.finish_reason == "stop")
    if done.constraint_met:
        assert isinstance(json.loads(done.text), dict)


def test_the_mask_allows_only_tokens_that_continue_the_grammar(smollm2):
    tokenizer = smollm2.tokenizer
    state = constrain.GrammarState(constrain.regex(r"[0-9]+"), tokenizer)
    allowed = np.flatnonzero(state.allowed()).tolist()
    assert allowed and all(tokenizer.token_bytes(t).isdigit() for t in allowed)
    assert not set(allowed) & tokenizer.eos_ids  # nothing yet: the output may not end
    state.consume(tokenizer.encode("7", add_special_tokens=False)[0])
    assert tokenizer.eos_ids <= set(np.flatnonzero(state.allowed()).tolist())  # now it may


def test_a_cut_output_is_flagged_not_passed_off_as_valid(smollm2):
    done = smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=5)
    assert done.finish_reason == "length" and done.constraint_met is False and done.parsed is None
    assert done.text.startswith("{")
    plain = smollm2.chat(TICKET_PROMPT, max_tokens=5)
    assert plain.constraint_met is None  # unconstrained: nothing to flag


def test_greedy_constrained_output_is_the_same_with_and_without_the_prefix_cache(smollm2, smollm2_path):
    first = smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=80)
    again = smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=80)
    assert again.timings.prefix_hit_tokens > 0
    with edgellm.load(smollm2_path, kv=replace(KVConfig.for_mode("fast"), prefix_cache_bytes=0)) as cold:
        uncached = cold.chat(TICKET_PROMPT, schema=Ticket, max_tokens=80)
    assert uncached.timings.prefix_hit_tokens == 0
    assert first.token_ids == again.token_ids == uncached.token_ids


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_speculative_guesses_are_checked_against_the_grammar(smollm2, kind):
    prompt = [{"role": "user", "content": "List three fruits as a JSON array of strings, then repeat it twice."}]
    schema = {"type": "array", "items": {"type": "string"}, "maxItems": 9}
    plain = smollm2.chat(prompt, schema=schema, max_tokens=60)
    fast = smollm2.chat(prompt, schema=schema, max_tokens=60, speculative=kind)
    assert fast.token_ids == plain.token_ids and fast.constraint_met == plain.constraint_met


@pytest.mark.slow
def test_gemma_fills_a_schema(gemma3_path):
    with edgellm.load(gemma3_path) as gemma:
        done = gemma.chat(TICKET_PROMPT, schema=Ticket, max_tokens=100)
        assert done.constraint_met and isinstance(done.parsed, Ticket)
        labels = ["billing", "bug", "other"]
        done = gemma.chat([{"role": "user", "content": "Classify: the app crashes on start."}],
                          constraint=constrain.choice(labels), max_tokens=10)
        assert done.text in labels


def test_a_token_loop_inside_a_constraint_is_broken(smollm2):
    tokenizer = smollm2.tokenizer
    five = tokenizer.encode("5", add_special_tokens=False)[0]
    state = constrain.GrammarState(constrain.regex(r"[0-9]+"), tokenizer)
    for _ in range(11):
        state.consume(five)
    assert state.allowed()[five]  # eleven fives may be a number
    state.consume(five)
    allowed = state.allowed()
    assert not allowed[five] and allowed.sum() > 1  # a twelfth is a loop: anything else may follow


def test_tokens_the_grammar_forces_are_checked_as_guesses_with_the_same_output(smollm2):
    for prompt in (TICKET_PROMPT, [{"role": "user", "content": "Ada is 36 and lives in London. Extract the contact."}]):
        plain = smollm2.chat(prompt, schema=Ticket, max_tokens=100, speculative="off")
        guessed = smollm2.chat(prompt, schema=Ticket, max_tokens=100)
        assert guessed.token_ids == plain.token_ids and guessed.constraint_met == plain.constraint_met
        assert plain.timings.drafted_tokens == 0
        assert guessed.timings.speculative == "grammar" and guessed.timings.accepted_tokens > 0
    with_lookup = smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=100, speculative="lookup")
    assert with_lookup.timings.speculative == "grammar+lookup"
    assert with_lookup.token_ids == smollm2.chat(TICKET_PROMPT, schema=Ticket, max_tokens=100,
                                                 speculative="off").token_ids
