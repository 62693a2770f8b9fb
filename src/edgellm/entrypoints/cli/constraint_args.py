"""The constraint flags of `edgellm run` (--json-schema, --json-object, --choice, --regex,
--grammar) and the files they name."""
from __future__ import annotations

import argparse
from pathlib import Path

from edgellm.errors import InvalidRequest


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", default=None, metavar="FILE", help="answer with JSON valid for this schema")
    group.add_argument("--json-object", action="store_true", help="answer with any JSON object")
    group.add_argument("--choice", default=None, metavar="A,B,...", help="answer with exactly one of these")
    group.add_argument("--regex", default=None, help="answer matching this regular expression")
    group.add_argument("--grammar", default=None, metavar="FILE", help="answer in this Lark or GBNF grammar")


def constraint_from_args(args: argparse.Namespace):
    """The constraint `run`'s flags ask for (checked before the model loads), or None."""
    from edgellm.generation import constrain

    if args.json_schema:
        return constrain.json_schema(read_file(args.json_schema, "schema"))
    if args.json_object:
        return constrain.any_json()
    if args.choice:
        return constrain.choice([c for c in args.choice.split(",") if c])
    if args.regex:
        return constrain.regex(args.regex)
    if args.grammar:
        return constrain.grammar(read_file(args.grammar, "grammar"))
    return None


def read_file(path: str, what: str) -> str:
    """A file named on the command line, as text; a clear error where it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"cannot read the {what} file {path}: {error}") from None
