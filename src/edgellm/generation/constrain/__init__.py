"""Structured output: constraints (JSON schema, any JSON, choice, regex, grammar) and the
per-sequence grammar state that masks logits so every output is valid."""
from edgellm.generation.constrain.matcher import GrammarState, grammar_tokenizer
from edgellm.generation.constrain.spec import (Constraint, InvalidConstraint, any_json, choice, grammar, json_schema,
                                    regex)

__all__ = ["Constraint", "GrammarState", "InvalidConstraint", "any_json", "choice", "grammar",
           "grammar_tokenizer", "json_schema", "regex"]
