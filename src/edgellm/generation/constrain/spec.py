"""What an output must match: a JSON schema, any JSON, a choice, a regex or a grammar, compiled
for llguidance (docs/structured-output.md has why that engine) and checked before any
generation: an invalid one is an InvalidConstraint naming what is wrong."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from edgellm.errors import InvalidRequest

# Whitespace as models write JSON (compact, or pretty-printed with newlines and indents), but
# bounded: with no whitespace allowed a model that wants a newline before "}" writes digits
# instead (Gemma 3: "total": 3.5055555...), with unbounded whitespace it may write newlines
# until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


class InvalidConstraint(InvalidRequest):
    """A schema, regex or grammar that cannot constrain generation (HTTP 400, CLI exit 2)."""

    def __init__(self, kind: str, problem: str):
        self.kind, self.problem = kind, problem.strip()
        super().__init__(f"invalid {kind.replace('_', ' ')}: {self.problem}")


@dataclass(frozen=True)
class Constraint:
    """A compiled output constraint. `grammar` is llguidance's grammar text; `parse` turns a
    finished output into the value it stands for."""
    kind: str  # "json_schema", "json", "choice", "regex", "grammar"
    grammar: str = field(repr=False)
    schema: dict | None = None  # the JSON schema (json_schema, json)
    choices: tuple[str, ...] = ()
    model: Any = None  # a pydantic model class the output parses into
    # What a chat prompt tells the model of the shape it must answer in (as OpenAI shows its
    # models the schema): without it a small model guesses keys the grammar then forbids.
    instructions: str | None = field(default=None, compare=False)
    # The output so far -> where it should end though the grammar allows more (tools: before a
    # repeated call), or None. What it keeps must be a whole valid output.
    cut: Callable[[str], int | None] | None = field(default=None, repr=False, compare=False)

    def parse(self, text: str) -> Any:
        """The value of a finished, valid output: a pydantic object, a dict/list, or the text."""
        if self.model is not None:
            return self.model.model_validate_json(text)
        if self.kind in ("json_schema", "json"):
            return json.loads(text)
        return text


def json_schema(schema: dict | str | type, strict: bool = True) -> Constraint:
    """Output that validates against a JSON schema (a dict, its JSON text, or a pydantic model).
    `strict` (OpenAI's strict mode, xgrammar's default) closes every object that does not say
    otherwise to the properties it lists: JSON Schema's default of any extra property lets a
    small model add keys until max_tokens."""
    model = schema if isinstance(schema, type) and hasattr(schema, "model_json_schema") else None
    if model is not None:
        schema = model.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidConstraint("json_schema", f"not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise InvalidConstraint("json_schema", f"a schema is a JSON object, got {type(schema).__name__}")
    compiled = closed_objects(schema) if strict else schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(compiled, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise InvalidConstraint("json_schema", str(error)) from None
    note = "Answer with only a JSON object that matches this JSON schema:\n" + json.dumps(compiled, ensure_ascii=False)
    return Constraint("json_schema", checked_grammar("json_schema", grammar), schema=schema, model=model, instructions=note)


def any_json() -> Constraint:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    schema = {"type": "object"}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    return Constraint("json", checked_grammar("json", grammar), schema=schema, instructions="Answer with only a JSON object.")


def choice(options: Sequence[str]) -> Constraint:
    """Exactly one of `options` (intent labels, yes/no)."""
    if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidConstraint("choice", "choices are a non-empty list of non-empty strings")
    lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
    return Constraint("choice", checked_grammar("choice", llguidance.LLMatcher.grammar_from_lark(lark)),
                      choices=tuple(options), instructions=f"Answer with exactly one of: {', '.join(options)}.")


def regex(pattern: str) -> Constraint:
    """Output that matches `pattern` whole (Rust regex syntax, as Python's for common patterns)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidConstraint("regex", "the pattern is empty")
    return Constraint("regex", checked_grammar("regex", llguidance.LLMatcher.grammar_from_regex(pattern)))


def grammar(text: str) -> Constraint:
    """Output of a context-free grammar: Lark syntax (llguidance's dialect, `start` rule) or
    llama.cpp's GBNF (`root ::= ...`)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidConstraint("grammar", "the grammar is empty")
    try:
        lark = any_to_lark(text)
    except Exception as error:  # the GBNF converter raises its own parse errors
        raise InvalidConstraint("grammar", str(error)) from None
    return Constraint("grammar", checked_grammar("grammar", llguidance.LLMatcher.grammar_from_lark(lark)))


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` whose objects without `additionalProperties` have it false."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    return out


def checked_grammar(kind: str, grammar_text: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar_text)
    if problem and not problem.startswith("WARNING"):
        raise InvalidConstraint(kind, problem)
    return grammar_text
