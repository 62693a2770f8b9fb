"""`edgellm run | chat | classify | extract | summarize | info | plan | bench | serve | pull | list | show | rm |
verify | convert | quantize | eval | lora`. Errors become one line on stderr and a
non-zero exit code; the table below is the one place that maps them."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from edgellm.entrypoints.cli import constraint_args, lora, quant, store, tasks
from edgellm.entrypoints.cli.generate import cmd_chat, cmd_run
from edgellm.entrypoints.cli.serve import cmd_serve
from edgellm.entrypoints.cli.tools import cmd_bench, cmd_info, cmd_plan, int_list
from edgellm.extras import ToolsNeeded
from edgellm.errors import (EdgeLLMError, InvalidRequest, ModelFormatError, ModelNotFound, OutOfMemoryBudget,
                            StoreError, UnsupportedModel)
from edgellm.registry import DEFAULT_MODEL, REGISTRY

# One place maps error types to exit codes (argparse itself exits 2 on bad flags).
EXIT_CODES: list[tuple[type[Exception], int]] = [
    (InvalidRequest, 2), (ModelNotFound, 3), (ModelFormatError, 4), (UnsupportedModel, 5), (OutOfMemoryBudget, 6),
    (ToolsNeeded, 7), (StoreError, 8), (EdgeLLMError, 1),
]


def _add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    names = ", ".join(REGISTRY)
    what = f"a store name (edgellm list), a built-in name ({names}), a .gguf, an HF folder or a quantized file"
    if several:
        p.add_argument("-m", "--model", action="append", default=[], metavar="[ID=]MODEL",
                       help=f"{what}; repeat it to serve several (loaded on demand), ID= names what clients ask for "
                            f"(default: {DEFAULT_MODEL})")
    else:
        p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=what)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--mode", choices=("fast", "exact"), default="fast",
                   help="fast: packed 4-bit weights, bf16 matmuls; exact: fp32 reference")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="RAM budget (e.g. 1.5GB): context and KV precision are planned to fit it")
    p.add_argument("--kv-precision", default=None, help="f16 (default), f32, bf16, int8, int4, or K:V such as int8:int4")
    p.add_argument("--kv-window", type=int, default=None, metavar="TOKENS",
                   help="keep at most this many tokens (attention sinks + sliding window): endless chat")
    p.add_argument("--prefix-cache", default=None, metavar="SIZE",
                   help="KV kept for reuse by later prompts with the same start (e.g. 64MB; 0 turns it off; "
                        "default: a quarter of --memory's KV budget, else 1/16 of free RAM up to 256 MiB)")
    p.add_argument("--speculative", choices=("lookup", "draft", "self", "off"), default=None,
                   help="speculative decoding: lookup (continue text the prompt repeats), draft (a --draft "
                        "model with the same vocabulary), self (the model's first layers); same text, fewer passes")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model for --speculative draft (a registered name or path; same vocabulary)")
    p.add_argument("--lora", action="append", default=[], metavar="[NAME=]PATH[@SCALE]",
                   help="a LoRA adapter (PEFT folder or GGUF LoRA) over the model; serve: repeatable, requests "
                        "pick one as model 'BASE:NAME'; run / chat answer under it")


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
    constraint_args.add_constraint_args(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    chat.add_argument("--system", default=None)
    chat.add_argument("-v", "--verbose", action="store_true", help="statistics after each reply")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="TTFT, prefill/decode speed and peak RSS, side by side with llama.cpp")
    bench.add_argument("-m", "--model", default=DEFAULT_MODEL, help="comma-separated names or paths")
    bench.add_argument("--threads", type=int_list, default=None, help="e.g. 1,2 (default: physical cores)")
    bench.add_argument("--prompt-tokens", type=int_list, default=[128, 512])
    bench.add_argument("--gen-tokens", type=int, default=128)
    bench.add_argument("--repeat", type=int, default=3, help="timed runs per engine process")
    bench.add_argument("--rounds", type=int, default=1,
                       help="engine processes per engine, taking turns (steadier ratios on a noisy machine)")
    bench.add_argument("--mode", choices=("fast", "exact"), default="fast")
    bench.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparison")
    bench.add_argument("--json", action="store_true", help="print the full report as JSON")
    bench.add_argument("--plot", default=None, metavar="PNG", help="write speed vs prompt length / threads")
    bench.add_argument("--op-times", action="store_true", help="print where decode time goes, per op type (torch profiler)")
    bench.add_argument("--memory", action="store_true",
                       help="RSS and KV bytes against context length for each KV precision (--plot for a PNG)")
    bench.add_argument("--kv-speed", action="store_true",
                       help="decode tok/s per KV precision (f16, int8, int4) against context, taking turns in one process")
    bench.add_argument("--prefix", action="store_true", help="TTFT with and without a cached 1,000-token prefix")
    bench.add_argument("--soak", type=int, default=0, metavar="TOKENS",
                       help="stream this many tokens through the sliding window, sampling RSS")
    bench.add_argument("--serving", action="store_true",
                       help="aggregate tok/s with 1, 2, 4 concurrent streams: throughput vs latency mode")
    bench.add_argument("--kv-window", type=int, default=None, help="window for --soak (default 512)")
    bench.add_argument("--speculative", action="store_true",
                       help="decode tok/s with prompt lookup, a draft model (INT8 target, 4-bit draft) and "
                            "self-speculation against plain decoding, and whether the tokens were the same")
    bench.add_argument("--constrained", action="store_true",
                       help="decode tok/s under a JSON-schema constraint against plain decoding, mask ms per "
                            "token and grammar compile times (comma-separated -m for several models)")
    bench.add_argument("--lora", action="store_true",
                       help="decode tok/s with a rank-16 adapter against the base, a 4-stream batch of 4 adapters "
                            "against one, RSS of resident adapters against their files, training tokens/s")
    bench.add_argument("--architectures", action="store_true",
                       help="decode / prefill tok/s of every supported architecture per weight byte, vs Llama "
                            "(synthetic Q8_0 models of one size)")
    bench.add_argument("--quant", default=None, metavar="SRC[,SRC]",
                       help="float model(s) (HF folder or GGUF): size / quality / decode speed of each --recipes")
    bench.add_argument("--recipes", default="int8,int4-g32,int4-g32+awq,int4-g32-asym,int4-g128,mixed,mixed-small",
                       help="comma-separated recipes for --quant; '+awq' calibrates")
    bench.add_argument("--keep", default=None, metavar="DIR", help="keep --quant's quantized files here")
    bench.add_argument("--footprint", action="store_true",
                       help="installed size, import time, and a whole `run` process (wall time, peak RSS) per engine")
    bench.add_argument("--serve-memory", type=int, metavar="REQUESTS",
                       help="a default `edgellm serve` answering this many distinct chat prompts: its RSS against "
                            "the KV and prefix cache gauges")
    bench.add_argument("--sizes", nargs="?", const="qwen2.5-0.5b,llama-3.2-1b,qwen2.5-1.5b,gemma-3-1b,llama-3.2-3b",
                       default=None, metavar="SHAPE[,SHAPE]",
                       help="random-weight models of real shapes (made once, cached): speed, load, memory and the "
                            "share of the read bandwidth, against llama.cpp (also: qwen2.5-3b, qwen2.5-7b, "
                            "llama-3.1-8b)")
    bench.add_argument("--embeddings", action="store_true",
                       help="embedding vectors a second (short and long texts) for each -m model")
    bench.add_argument("--store", action="store_true",
                       help="pull throughput from an HTTP server on 127.0.0.1 into an empty store, and hot-swap "
                            "times (load, canary, switch) for each -m model (e.g. -m smollm2-135m,gemma3-270m)")
    bench.add_argument("--context", type=int_list, default=None, metavar="N[,N]",
                       help="with --sizes: decode tok/s after N tokens of context instead, f16 and int8 KV, "
                            "against llama.cpp's F16 and Q8_0 caches")
    bench.add_argument("--weight-types", default="Q4_K_M,Q4_0,Q8_0",
                       help="comma-separated weight types for --sizes (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0)")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, SSE, /metrics)")
    _add_model_args(serve, several=True)
    serve.add_argument("--keep-alive", default=None, metavar="TIME",
                       help="how long an unused model stays loaded: seconds, 5m, 1h or never (default: never for one "
                            "model, 5m for several)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health, "
                            "/metrics and the chat page")
    serve.add_argument("--kv-dir", default=None, metavar="DIR",
                       help="where /admin/kv saves conversations' KV (default: the cache's kv/ folder)")
    serve.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let pages from this origin call the server (repeatable; '*' for any; default: none)")
    serve.add_argument("--profile", default=None, help="device profile: phone, tablet, desktop or a .toml path")
    serve.add_argument("--queue-limit", type=int, default=None, help="requests that may wait; more get 429 (3)")
    serve.add_argument("--timeout", type=float, default=None, help="seconds per request before partial output (15)")
    serve.add_argument("--fallback-model", default=None,
                       help="a smaller model for requests that do not fit, or while the device is hot")
    serve.add_argument("--fallback-url", default=None, metavar="URL",
                       help="opt-in cloud fallback: an OpenAI-compatible API (e.g. https://host/v1) for requests that "
                            "allow it (edgellm.cloud_fallback) when this device cannot answer them")
    serve.add_argument("--fallback-key-env", default="EDGELLM_FALLBACK_API_KEY", metavar="VAR",
                       help="the environment variable holding the upstream's API key (EDGELLM_FALLBACK_API_KEY)")
    serve.add_argument("--fallback-on", default="busy,context,model,memory,hot", metavar="REASONS",
                       help="when to fall back: busy, context, model, memory, hot (default: all)")
    serve.add_argument("--fallback-upstream-model", default=None, metavar="ID",
                       help="the upstream's model id (default: the one the request names)")
    serve.add_argument("--thermal-source", default=None,
                       help="file with the temperature (°C or millidegrees); default: Linux thermal zones")
    serve.add_argument("--thermal-threshold", type=float, default=75.0, help="°C above which decoding slows")
    serve.add_argument("--log-text", action="store_true", help="debug: also log prompts (off by default)")
    serve.set_defaults(func=cmd_serve)

    plan = sub.add_parser("plan", help="fit a model into a RAM budget: context length and KV precision")
    plan.add_argument("--memory", required=True, metavar="SIZE", help="e.g. 1.5GB, 800MB")
    plan.add_argument("-m", "--model", default=DEFAULT_MODEL)
    plan.add_argument("--context", type=int, default=None, help="the context you want (default: the model's)")
    plan.add_argument("--lora", action="append", default=[], metavar="[NAME=]PATH",
                      help="LoRA adapters that will be resident beside the model (repeatable)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    info = sub.add_parser("info", help="describe a model file")
    info.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    store.add_parsers(sub)
    quant.add_parsers(sub)
    tasks.add_parsers(sub, _add_model_args)
    lora.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`edgellm plan | head -1`): stop quietly, as `cat` would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail again
        return 128 + signal.SIGPIPE
    except Exception as error:  # noqa: BLE001 - translated below, re-raised if not ours
        if isinstance(error, ModuleNotFoundError) and ToolsNeeded.of(error) is not None:
            error = ToolsNeeded.of(error)
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
