"""`edgellm run` and `edgellm chat`: load, stream tokens to the terminal, report timings."""
from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from typing import Any, Callable

from edgellm.errors import InvalidRequest


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def loads_a_model(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command whose process keeps the model it loads (through load_model): its imports (torch)
    and the load run without Python's cycle collector (~0.25 s of `edgellm run`), and load_model
    freezes what they made before it turns the collector back on."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        gc.disable()
        try:
            return command(args)
        finally:
            gc.enable()  # load_model did, unless the command failed before it
    return run


def load_model(args: argparse.Namespace, context_length: int | None = None):
    from edgellm.store import resolve

    if args.threads is not None and args.threads < 1:
        raise InvalidRequest(f"threads must be >= 1, got {args.threads}")
    path = resolve(args.model)  # a bad name fails here, before the slow torch import
    from edgellm import kernels
    from edgellm.api.loader import load
    from edgellm.memory import keep_out_of_collections

    kv = _kv_config(args)
    kernels.library()  # a first run compiles them here: its line before ours
    print(f"loading {args.model} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        model = load(path, mode=args.mode, threads=args.threads, kv=kv, memory_budget=args.memory,
                     context_length=context_length, speculative=args.speculative, draft=args.draft,
                     lora=lora_specs(args))
    finally:
        print(f" {time.perf_counter() - start:.2f} s", file=sys.stderr)
    keep_out_of_collections()  # a command's process keeps its model to the end
    gc.enable()  # the pause loads_a_model began ends here: what comes next makes its own garbage
    return model


def lora_specs(args: argparse.Namespace) -> dict[str, tuple[str, float]]:
    """--lora flags as name -> (path, scale)."""
    specs = {}
    for spec in getattr(args, "lora", []):
        path, name, scale = parse_lora(spec)
        if name in specs:
            raise InvalidRequest(f"two --lora adapters are named {name!r}: name them (--lora NAME=PATH)")
        specs[name] = (path, scale)
    return specs


def parse_lora(spec: str) -> tuple[str, str, float]:
    """`[NAME=]PATH[@SCALE]` -> (path, name, scale); the name defaults to the file or folder name."""
    from pathlib import Path

    name, _, path = spec.partition("=")
    if not path or "/" in name:  # no '=', or one inside the path
        name, path = "", spec
    scale = 1.0
    head, _, tail = path.rpartition("@")
    if head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass  # an '@' inside the path
    return path, name or Path(path).stem, scale


def adapter_choice(args: argparse.Namespace) -> dict[str, Any]:
    """run, chat and the task commands answer under the one --lora given."""
    specs = getattr(args, "lora", [])
    if len(specs) > 1:
        raise InvalidRequest(f"this command answers under one --lora, got {len(specs)} (serve keeps several)")
    return {"adapter": parse_lora(specs[0])[1]} if specs else {}


def _kv_config(args: argparse.Namespace):
    from dataclasses import replace

    from edgellm.kv import KVConfig
    from edgellm.kv.config import split_precision

    prefix = getattr(args, "prefix_cache", None)
    if args.kv_precision is None and args.kv_window is None and prefix is None:
        return None
    from edgellm.api.planner import parse_bytes

    smallest = KVConfig.sinks + 2 * KVConfig.block_size
    if args.kv_window is not None and args.kv_window < smallest:
        raise InvalidRequest(f"--kv-window must be at least {smallest} tokens (the attention sinks and two KV blocks)")
    config = KVConfig(max_tokens=args.kv_window, prefix_cache_bytes=None if prefix is None else parse_bytes(prefix))
    if args.kv_precision:
        k, v = split_precision(args.kv_precision)
        config = replace(config, k_precision=k, v_precision=v)
    return KVConfig(**config.__dict__)  # re-validated


def _print_stream(events) -> Any:
    from edgellm.generation import Completion

    for event in events:
        if isinstance(event, Completion):
            print(event.tail, flush=True)
            return event
        print(event.text, end="", flush=True)


def _stats(done) -> str:
    t = done.timings
    return (f"[{t.prompt_tokens} prompt tokens, {t.completion_tokens} generated, finish={done.finish_reason}; "
            f"TTFT {t.ttft_s * 1000:.0f} ms, prefill {t.prefill_tokens_per_s:.0f} tok/s, "
            f"decode {t.decode_tokens_per_s:.1f} tok/s, peak RSS {t.peak_rss_bytes / 2**20:.0f} MiB"
            + (f"; {t.speculative}: {t.accepted_tokens}/{t.drafted_tokens} guesses kept, "
               f"{t.tokens_per_pass:.2f} tokens per pass" if t.speculative else "") + "]")


@loads_a_model
def cmd_run(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    from edgellm.generation import SamplingParams
    from edgellm.api.model import last_completion

    SamplingParams(**sampling)  # reject bad flags before spending time on loading
    from edgellm.entrypoints.cli.constraint_args import constraint_from_args

    constraint = constraint_from_args(args)
    if constraint is not None:
        sampling["constraint"] = constraint
    sampling |= adapter_choice(args)
    with load_model(args) as model:
        if args.raw:
            events = model.stream(args.prompt, **sampling)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            events = model.chat(messages + [{"role": "user", "content": args.prompt}], stream=True, **sampling)
        if args.json:
            done = last_completion(events)
            met = {} if done.constraint_met is None else {"constraint_met": done.constraint_met}
            print(json.dumps({"text": done.text, "finish_reason": done.finish_reason,
                              "token_ids": list(done.token_ids), **met, "timings": done.timings.as_dict()}))
        else:
            done = _print_stream(events)
            if not args.quiet:
                print(_stats(done), file=sys.stderr)
    return 0


@loads_a_model
def cmd_chat(args: argparse.Namespace) -> int:
    from edgellm.entrypoints.cli.chat import Conversation

    sampling = _sampling(args) | adapter_choice(args)
    with load_model(args) as model:
        talk = Conversation(model, args.system, _stats)
        print("chat with the model; /help lists the commands, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if talk.command(line):
                if talk.ended:
                    return 0
                continue
            if not line.strip():
                continue
            talk.messages.append({"role": "user", "content": line[1:] if line.startswith("//") else line})
            done = _print_stream(model.chat(talk.messages, stream=True, **sampling))
            talk.answered(done)
            if args.verbose:
                print(_stats(done), file=sys.stderr)
