"""`edgellm classify | extract | summarize`: the task presets (api/tasks.py) on the command
line."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from edgellm.entrypoints.cli.constraint_args import read_file
from edgellm.entrypoints.cli.generate import loads_a_model
from edgellm.errors import InvalidRequest


def add_parsers(sub, add_model_args) -> None:
    classify = sub.add_parser("classify", help="label texts with one of --labels (or score a labelled set)")
    classify.add_argument("text", nargs="*", help="texts to label (default: one per line on stdin)")
    classify.add_argument("--labels", required=True, help="comma-separated, e.g. billing,bug,other")
    classify.add_argument("--instructions", default="", help="what the labels mean, added to the prompt")
    classify.add_argument("--eval", default=None, metavar="JSONL",
                          help='a labelled set ({"text": ..., "label": ...} per line): print accuracy')
    classify.add_argument("--json", action="store_true")
    add_model_args(classify)
    classify.set_defaults(func=cmd_classify)

    extract = sub.add_parser("extract", help="read a JSON object of a schema out of a text")
    extract.add_argument("text", help="the text, or @FILE to read it from a file")
    extract.add_argument("--schema", required=True, metavar="JSON", help="a JSON schema file")
    extract.add_argument("--instructions", default="")
    extract.add_argument("-n", "--max-tokens", type=int, default=512)
    add_model_args(extract)
    extract.set_defaults(func=cmd_extract)

    summarize = sub.add_parser("summarize", help="summarize a text file (any length: long ones in parts)")
    summarize.add_argument("file", help="a text file, or - for stdin")
    summarize.add_argument("--words", type=int, default=80, help="at most about this many words")
    add_model_args(summarize)
    summarize.set_defaults(func=cmd_summarize)


@loads_a_model
def cmd_classify(args: argparse.Namespace) -> int:
    from edgellm.entrypoints.cli.generate import adapter_choice, load_model
    from edgellm.api.tasks import classify

    labels = [x.strip() for x in args.labels.split(",") if x.strip()]
    if len(labels) < 2:
        raise InvalidRequest("--labels needs at least two labels")
    rows = _labelled(args.eval, labels) if args.eval else [{"text": t} for t in (args.text or _stdin_lines())]
    with load_model(args) as model:
        for row in rows:
            row["predicted"] = classify(model, row["text"], labels, instructions=args.instructions,
                                        **adapter_choice(args))
            if not args.eval and not args.json:
                print(row["predicted"], flush=True)
    if args.eval:
        report = _accuracy(rows, labels)
        print(json.dumps(report) if args.json else _accuracy_text(report))
    elif args.json:
        print(json.dumps([{"text": r["text"], "label": r["predicted"]} for r in rows], ensure_ascii=False))
    return 0


@loads_a_model
def cmd_extract(args: argparse.Namespace) -> int:
    from edgellm.generation import constrain
    from edgellm.entrypoints.cli.generate import adapter_choice, load_model
    from edgellm.api.tasks import extract

    schema = read_file(args.schema, "schema")
    constrain.json_schema(schema)  # an invalid schema fails before the model loads
    text = read_file(args.text[1:], "text") if args.text.startswith("@") else args.text
    with load_model(args) as model:
        value = extract(model, text, schema, instructions=args.instructions, max_tokens=args.max_tokens,
                        **adapter_choice(args))
    print(json.dumps(value, ensure_ascii=False))
    return 0


@loads_a_model
def cmd_summarize(args: argparse.Namespace) -> int:
    from edgellm.entrypoints.cli.generate import adapter_choice, load_model
    from edgellm.api.tasks import summarize

    text = sys.stdin.read() if args.file == "-" else read_file(args.file, "text")
    if not text.strip():
        raise InvalidRequest("the text to summarize is empty")

    def progress(done: int, total: int) -> None:
        if total > 1:
            print(f"summarizing: part {done}/{total}", file=sys.stderr, flush=True)

    with load_model(args) as model:
        print(summarize(model, text, words=args.words, progress=progress, **adapter_choice(args)))
    return 0


def _stdin_lines() -> list[str]:
    return [line.strip() for line in sys.stdin if line.strip()]


def _labelled(path: str, labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(read_file(path, "labelled set").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, label = row["text"], row["label"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InvalidRequest(f'{path}:{number}: expected {{"text": ..., "label": ...}}') from None
        if label not in labels:
            raise InvalidRequest(f"{path}:{number}: label {label!r} is not one of --labels")
        rows.append({"text": text, "label": label})
    if not rows:
        raise InvalidRequest(f"{path} holds no labelled texts")
    return rows


def _accuracy(rows: list[dict], labels: list[str]) -> dict[str, Any]:
    right = sum(r["predicted"] == r["label"] for r in rows)
    confusion = Counter((r["label"], r["predicted"]) for r in rows)
    return {"examples": len(rows), "accuracy": right / len(rows),
            "predicted": dict(Counter(r["predicted"] for r in rows)),
            "confusion": {truth: {p: confusion[truth, p] for p in labels} for truth in labels}}


def _accuracy_text(report: dict) -> str:
    lines = [f"accuracy {report['accuracy']:.1%} on {report['examples']} examples",
             "true \\ predicted: " + "  ".join(report["confusion"])]
    lines += [f"  {truth}: " + "  ".join(str(n) for n in row.values()) for truth, row in report["confusion"].items()]
    return "\n".join(lines)
