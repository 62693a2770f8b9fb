"""Constrained JSON that fits its budget: the closer's shortest endings (checked by the grammar
itself), and real generations under a tight max_tokens that all parse, end "stop" and say they
were closed early, without going over the budget."""
from __future__ import annotations

import json

import pytest

import edgellm
from edgellm.generation.constrain import json_schema
from edgellm.generation.constrain.closing import CannotClose, JsonCloser
from edgellm.generation.constrain.matcher import GrammarState

TICKET = {"type": "object", "required": ["category", "urgency", "summary", "steps", "contact"], "properties": {
    "category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
    "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string"},
    "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "contact": {"type": "object", "required": ["email"], "properties": {"email": {"type": "string"}}}}}
TICKETS = ["My card was charged twice for the same order and I need a refund today.",
           "The app crashes every time I open the settings page on Android 14.",
           "I forgot my password and the reset email never arrives.",
           "Can you add a dark mode to the desktop version?",
           "Invoice #4411 shows the wrong VAT rate for Germany.",
           "After the last update, sync between my phone and laptop stopped working.",
           "I want to close my account and delete all my data.",
           "The checkout button does nothing in Safari.",
           "How do I export my notes as PDF?",
           "Two-factor codes arrive after they have already expired."]


PREFIXES = ["", "{", "{\"cat", "{\"category\"", "{\"category\": ", "{\"category\": \"bug\"",
            "{\"category\": \"bug\",", "{\"category\": \"bug\", \"urgency\": 3",
            "{\"category\": \"bug\", \"urgency\": 3, \"summary\": \"It cra",
            "{\"category\": \"bug\", \"urgency\": 3, \"summary\": \"a \\\\",
            "{\"category\": \"bug\", \"urgency\": 3, \"summary\": \"\", \"steps\": [",
            "{\"category\": \"bug\", \"urgency\": 3, \"summary\": \"\", \"steps\": [\"open\",",
            "{\"category\": \"bug\", \"urgency\": 3, \"summary\": \"\", \"steps\": [\"x\"], \"contact\": {\"em",
            "{\n  \"category\": \"other\",\n  \"urgency\": 5,\n  \"summary\": \"x\",\n  \"steps\": [\n    \"x\"\n  ]"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_the_closing_is_the_shortest_valid_end_the_grammar_takes(smollm2_path, prefix):
    with edgellm.load(smollm2_path) as model:
        state = GrammarState(json_schema(TICKET), model.tokenizer)
        tokens = model.tokenizer.encode(prefix, add_special_tokens=False)
        assert state.valid_prefix(tokens) == len(tokens)  # a prefix the grammar itself allows
        for token in tokens:
            state.consume(token)
        closing = JsonCloser(TICKET).closing(prefix)
        assert set(TICKET["required"]) <= set(json.loads(prefix + closing))
        assert state.closing_tokens(closing) is not None  # the grammar takes it and may end after it


def test_what_it_cannot_close_it_says():
    with pytest.raises(CannotClose):
        JsonCloser({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                    "required": ["id"]}).closing("{")


@pytest.mark.parametrize("budget", [30, 60])
def test_every_ticket_parses_within_a_tight_budget(smollm2_path, budget):
    with edgellm.load(smollm2_path) as model:
        for ticket in TICKETS:
            done = model.chat([{"role": "user", "content": "Summarize this support ticket: " + ticket}],
                              schema=TICKET, max_tokens=budget, temperature=0)
            value = json.loads(done.text)
            assert set(TICKET["required"]) <= set(value) and done.parsed == value
            assert done.finish_reason == "stop" and done.constraint_met
            assert done.timings.completion_tokens <= budget


def test_unconstrained_and_roomy_outputs_are_unchanged(smollm2_path):
    with edgellm.load(smollm2_path) as model:
        plain = model.chat([{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
        roomy = model.chat([{"role": "user", "content": "Summarize: " + TICKETS[3]}],
                           schema={"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]},
                           max_tokens=200, temperature=0)
    assert not plain.closed_early and plain.constraint_met is None
    assert not roomy.closed_early and roomy.constraint_met
