"""`edgellm run | chat | info`. Errors become one line on stderr and a non-zero exit code."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

from edgellm.errors import (EdgeLLMError, InvalidRequest, ModelFormatError, ModelNotFound, OutOfMemoryBudget,
                            UnsupportedModel)
from edgellm.registry import DEFAULT_MODEL, REGISTRY

# One place maps error types to exit codes (argparse itself exits 2 on bad flags).
EXIT_CODES: list[tuple[type[Exception], int]] = [
    (InvalidRequest, 2), (ModelNotFound, 3), (ModelFormatError, 4), (UnsupportedModel, 5), (OutOfMemoryBudget, 6),
    (EdgeLLMError, 1),
]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    names = ", ".join(REGISTRY)
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"registered name ({names}) or a .gguf path")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--mode", choices=("fast", "exact"), default="fast",
                   help="fast: packed 4-bit weights, bf16 matmuls; exact: fp32 reference")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="RAM budget (e.g. 1.5GB): context and KV precision are planned to fit it")
    p.add_argument("--kv-precision", default=None, help="f32 (default), bf16, int8, int4, or K:V such as int8:int4")
    p.add_argument("--kv-window", type=int, default=None, metavar="TOKENS",
                   help="keep at most this many tokens (attention sinks + sliding window): endless chat")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _load(args: argparse.Namespace):
    from edgellm.registry import resolve

    if args.threads is not None and args.threads < 1:
        raise InvalidRequest(f"threads must be >= 1, got {args.threads}")
    path = resolve(args.model)  # a bad name fails here, before the slow torch import
    from edgellm.model import load

    kv = _kv_config(args)
    print(f"loading {args.model} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        model = load(path, mode=args.mode, threads=args.threads, kv=kv, memory_budget=args.memory)
    finally:
        print(f" {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return model


def _kv_config(args: argparse.Namespace):
    from dataclasses import replace

    from edgellm.kv import KVConfig

    if args.kv_precision is None and args.kv_window is None:
        return None
    config = KVConfig(max_tokens=args.kv_window)
    if args.kv_precision:
        k, _, v = args.kv_precision.partition(":")
        config = replace(config, k_precision=k, v_precision=v or k)
    return KVConfig(**config.__dict__)  # re-validated


def _print_stream(events) -> Any:
    from edgellm.generate import Completion

    for event in events:
        if isinstance(event, Completion):
            print(event.tail, flush=True)
            return event
        print(event.text, end="", flush=True)


def _stats(done) -> str:
    t = done.timings
    return (f"[{t.prompt_tokens} prompt tokens, {t.completion_tokens} generated, finish={done.finish_reason}; "
            f"TTFT {t.ttft_s * 1000:.0f} ms, prefill {t.prefill_tokens_per_s:.0f} tok/s, "
            f"decode {t.decode_tokens_per_s:.1f} tok/s, peak RSS {t.peak_rss_bytes / 2**20:.0f} MiB]")


def cmd_run(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    from edgellm.generate import SamplingParams
    from edgellm.model import last_completion

    SamplingParams(**sampling)  # reject bad flags before spending time on loading
    with _load(args) as model:
        if args.raw:
            events = model.stream(args.prompt, **sampling)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            events = model.chat(messages + [{"role": "user", "content": args.prompt}], stream=True, **sampling)
        if args.json:
            done = last_completion(events)
            print(json.dumps({"text": done.text, "finish_reason": done.finish_reason,
                              "token_ids": list(done.token_ids), "timings": _timings_dict(done.timings)}))
        else:
            done = _print_stream(events)
            if not args.quiet:
                print(_stats(done), file=sys.stderr)
    return 0


def _timings_dict(t) -> dict[str, float]:
    return {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens, "ttft_s": t.ttft_s,
            "prefill_tokens_per_s": t.prefill_tokens_per_s, "decode_tokens_per_s": t.decode_tokens_per_s,
            "peak_rss_bytes": t.peak_rss_bytes}


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    with _load(args) as model:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        print("chat with the model; /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            done = _print_stream(model.chat(messages, stream=True, **sampling))
            messages.append({"role": "assistant", "content": done.text})
            if args.verbose:
                print(_stats(done), file=sys.stderr)


def cmd_info(args: argparse.Namespace) -> int:
    from edgellm.formats.gguf import open_gguf
    from edgellm.model import describe
    from edgellm.registry import resolve

    with open_gguf(resolve(args.model)) as source:
        info = describe(source)
    if args.json:
        print(json.dumps(info.as_dict(), indent=2))
        return 0
    types = ", ".join(f"{name}×{count}" for name, count in info.tensor_types.items())
    rows = [("file", info.path), ("name", info.name), ("architecture", info.architecture),
            ("file size", f"{info.file_bytes / 2**20:.1f} MiB"), ("parameters", f"{info.parameters / 1e6:.1f} M"),
            ("tensor types", types), ("context length", str(info.context_length)),
            ("KV bytes per token", f"{info.kv_bytes_per_token} (fp32 K+V, all layers)")]
    for key, value in rows:
        print(f"{key:>20}  {value}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from edgellm.bench.runner import BenchConfig, format_table, llama_cpp_available, run_bench
    from edgellm.threads import default_threads

    models = [m for m in args.model.split(",") if m]
    for model in models:
        resolve_model(model)
    if args.profile:
        return _profile(models[0], args)
    config = BenchConfig(models=models, threads=args.threads or [default_threads()], prompt_tokens=args.prompt_tokens,
                         gen_tokens=args.gen_tokens, repeat=args.repeat, mode=args.mode,
                         llama_cpp=not args.no_llama_cpp)
    if config.llama_cpp and not llama_cpp_available():
        print("llama-cpp-python is not installed (pip install '.[bench]'): edgellm only", file=sys.stderr)
    report = run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.plot:
        from edgellm.bench.plot import plot_report

        print(f"plot written to {plot_report(report, args.plot)}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _profile(model_name: str, args: argparse.Namespace) -> int:
    from edgellm.bench.profile import profile_decode
    from edgellm.model import load

    threads = args.threads[0] if args.threads else None
    with load(model_name, mode=args.mode, threads=threads) as model:
        print(profile_decode(model, prompt_tokens=args.prompt_tokens[0]))
    return 0


def resolve_model(name: str):
    from edgellm.registry import resolve

    return resolve(name)


def cmd_plan(args: argparse.Namespace) -> int:
    from edgellm.planner import plan_file

    result = plan_file(resolve_model(args.model), args.memory, want_context=args.context, name=args.model)
    if not result.fits:
        others = [name for name in REGISTRY if name != args.model
                  and plan_file(resolve_model(name), args.memory, want_context=args.context).fits]
        if others:
            result.advice.append(f"models that fit this budget: {', '.join(others)}")
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0 if result.fits else 6
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    print(f"{args.model} in {mib(result.budget_bytes)}: " + (
        f"fits with {result.context_length} tokens of {result.kv_precision} KV" if result.fits else "does NOT fit"))
    rows = [("runtime (Python + torch)", result.runtime_bytes), ("weights", result.weights_bytes),
            ("tokenizer", result.tokenizer_bytes), ("activation scratch", result.scratch_bytes),
            ("safety margin", result.margin_bytes), ("KV cache at that context", result.kv_bytes)]
    for label, value in rows:
        print(f"  {label:<26}{mib(value):>12}")
    print("  KV precision   bytes/token   max context")
    for option in result.options:
        print(f"  {option.precision:<15}{option.bytes_per_token:>11,}   {option.max_context:>11,}")
    for line in result.advice:
        print(f"  note: {line}")
    return 0 if result.fits else 6


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgellm", description="On-device LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate a reply to one prompt, streamed to the terminal")
    run.add_argument("prompt")
    run.add_argument("--system", default=None, help="system message (chat mode)")
    run.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    run.add_argument("--json", action="store_true", help="print the completion and timings as JSON")
    run.add_argument("-q", "--quiet", action="store_true", help="no statistics line")
    _add_model_args(run)
    _add_sampling_args(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    chat.add_argument("--system", default=None)
    chat.add_argument("-v", "--verbose", action="store_true", help="statistics after each reply")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="TTFT, prefill/decode speed and peak RSS, side by side with llama.cpp")
    bench.add_argument("-m", "--model", default=DEFAULT_MODEL, help="comma-separated names or paths")
    bench.add_argument("--threads", type=_int_list, default=None, help="e.g. 1,2 (default: physical cores)")
    bench.add_argument("--prompt-tokens", type=_int_list, default=[128, 512])
    bench.add_argument("--gen-tokens", type=int, default=128)
    bench.add_argument("--repeat", type=int, default=3)
    bench.add_argument("--mode", choices=("fast", "exact"), default="fast")
    bench.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparison")
    bench.add_argument("--json", action="store_true", help="print the full report as JSON")
    bench.add_argument("--plot", default=None, metavar="PNG", help="write speed vs prompt length / threads")
    bench.add_argument("--profile", action="store_true", help="print where decode time goes, per op type")
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="fit a model into a RAM budget: context length and KV precision")
    plan.add_argument("--memory", required=True, metavar="SIZE", help="e.g. 1.5GB, 800MB")
    plan.add_argument("-m", "--model", default=DEFAULT_MODEL)
    plan.add_argument("--context", type=int, default=None, help="the context you want (default: the model's)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    info = sub.add_parser("info", help="describe a model file")
    info.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - translated below, re-raised if not ours
        code = _exit_code(error)
        if code is None:
            raise
        print(f"edgellm: error: {error}", file=sys.stderr)
        return code


def _exit_code(error: Exception) -> int | None:
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return None


if __name__ == "__main__":
    sys.exit(main())
