"""`edgellm info | plan | bench | serve`: describe a file, fit it into memory, measure it, serve it."""
from __future__ import annotations

import argparse
import json
import sys

from edgellm.entrypoints.cli.generate import loads_a_model
from edgellm.registry import REGISTRY


def cmd_info(args: argparse.Namespace) -> int:
    from edgellm import kernels
    from edgellm.io import open_model
    from edgellm.api.model import describe
    from edgellm.store import resolve

    with open_model(resolve(args.model)) as source:
        info = describe(source)
    if args.json:
        print(json.dumps(info.as_dict() | {"kernels": kernels.describe()}, indent=2))
        return 0
    types = ", ".join(f"{name}×{count}" for name, count in info.tensor_types.items())
    rows = [("file", info.path), ("name", info.name), ("architecture", info.architecture),
            ("file size", f"{info.file_bytes / 2**20:.1f} MiB"), ("parameters", f"{info.parameters / 1e6:.1f} M"),
            ("tensor types", types), ("context length", str(info.context_length)),
            ("KV bytes per token", f"{info.kv_bytes_per_token} (f16 K+V, the default, over the layers that grow with the context)"),
            ("kernels", kernels.describe() + " (this CPU; EDGELLM_ISA picks another variant)")]
    for key, value in rows:
        print(f"{key:>20}  {value}")
    return 0


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from edgellm.entrypoints.bench.runner import BenchConfig, format_table, llama_cpp_available, run_bench
    from edgellm.threads import default_threads

    if args.quant:
        return _bench_quant(args)
    if args.sizes:
        return _bench_sizes(args)
    if args.architectures:
        from edgellm.entrypoints.bench.architectures import architecture_report

        report = architecture_report(progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2))
        return 0
    models = [m for m in args.model.split(",") if m]
    for model in models:
        resolve_model(model)
    if args.op_times:
        return _op_times(models[0], args)
    if args.footprint:
        from edgellm.entrypoints.bench.footprint import footprint_report, format_footprint

        report = footprint_report(models, (args.threads or [default_threads()])[0], repeat=args.repeat,
                                  llama_cpp=not args.no_llama_cpp,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_footprint(report))
        return 0
    if args.embeddings:
        from edgellm.entrypoints.bench.embeddings import embeddings_report, format_embeddings

        report = embeddings_report(models, repeat=args.repeat, threads=(args.threads or [None])[0],
                                   progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_embeddings(report))
        return 0
    if args.store:
        from edgellm.entrypoints.bench.store import format_store, store_report

        report = store_report(models, repeat=args.repeat, threads=(args.threads or [None])[0],
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_store(report))
        return 0
    if args.serve_memory:
        from edgellm.entrypoints.bench.serve_memory import format_serve_memory, serve_memory

        report = serve_memory(models[0], requests=args.serve_memory,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_serve_memory(report))
        return 0
    if args.speculative:
        from edgellm.entrypoints.bench.speculative import format_speculative, speculative_report

        report = speculative_report(models[0], gen_tokens=args.gen_tokens, repeat=args.repeat,
                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
        if args.plot:
            from edgellm.entrypoints.bench.speculative import plot_speculative

            print(f"plot written to {plot_speculative(report, args.plot)}", file=sys.stderr)
        print(json.dumps(report, indent=2) if args.json else format_speculative(report))
        return 0
    if args.lora:
        from edgellm.entrypoints.bench.lora import format_lora, lora_report

        report = lora_report(models[0], gen_tokens=args.gen_tokens, repeat=args.repeat,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_lora(report))
        return 0
    if args.constrained:
        from edgellm.entrypoints.bench.constrained import constrained_report, format_constrained

        report = constrained_report(models, gen_tokens=args.gen_tokens, repeat=args.repeat,
                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(report, indent=2) if args.json else format_constrained(report))
        return 0
    if args.memory or args.kv_speed or args.prefix or args.soak or args.serving:
        return _bench_memory(models[0], args)
    config = BenchConfig(models=models, threads=args.threads or [default_threads()], prompt_tokens=args.prompt_tokens,
                         gen_tokens=args.gen_tokens, repeat=args.repeat, rounds=args.rounds, mode=args.mode,
                         llama_cpp=not args.no_llama_cpp)
    if config.llama_cpp and not llama_cpp_available():
        print("llama-cpp-python is not installed (pip install '.[bench]'): edgellm only", file=sys.stderr)
    report = run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.plot:
        from edgellm.entrypoints.bench.plot import plot_report

        print(f"plot written to {plot_report(report, args.plot)}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _bench_sizes(args: argparse.Namespace) -> int:
    from edgellm.entrypoints.bench import context, sizes
    from edgellm.threads import default_threads

    shapes, types = [s for s in args.sizes.split(",") if s], [t for t in args.weight_types.split(",") if t]
    common = dict(threads=(args.threads or [default_threads()])[0], gen_tokens=args.gen_tokens,
                  llama_cpp=not args.no_llama_cpp, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.context:
        report = context.contexts_report(shapes, types, args.context, **common)
        plot, text = context.plot_context, context.format_contexts
    else:
        report = sizes.sizes_report(shapes, types, prompt_tokens=args.prompt_tokens, repeat=args.repeat,
                                    rounds=args.rounds, **common)
        plot, text = sizes.plot_sizes, sizes.format_sizes
    if args.plot:
        print(f"plot written to {plot(report, args.plot)}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else text(report))
    return 0


def _bench_quant(args: argparse.Namespace) -> int:
    import tempfile

    from edgellm.entrypoints.bench.quant import format_quant_table, plot_quant, quant_sweep

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    reports = []
    for source in args.quant.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            reports.append(quant_sweep(source, recipes, args.keep or tmp,
                                       progress=lambda line: print(line, file=sys.stderr, flush=True)))
    if args.plot:
        print(f"plot written to {plot_quant(reports, args.plot)}", file=sys.stderr)
    print(json.dumps(reports, indent=2) if args.json else "\n\n".join(format_quant_table(r) for r in reports))
    return 0


def _bench_memory(model_name: str, args: argparse.Namespace) -> int:
    from edgellm.entrypoints.bench import memory

    if args.serving:
        from edgellm.entrypoints.bench.serving import interleaving, throughput

        report = dict(throughput=throughput(model_name), interleaving=interleaving(model_name))
    elif args.memory:
        report = memory.memory_report(model_name)
        if args.plot:
            memory.plot_memory(report, args.plot)
            print(f"plot written to {args.plot}", file=sys.stderr)
    elif args.kv_speed:
        report = memory.kv_decode_speed(model_name)
    elif args.prefix:
        report = memory.prefix_ttft(model_name)
    else:
        report = memory.soak(model_name, tokens=args.soak, window=args.kv_window or 512)
    print(json.dumps(report, indent=2))
    return 0


def _op_times(model_name: str, args: argparse.Namespace) -> int:
    from edgellm.entrypoints.bench.profile import profile_decode
    from edgellm.api.loader import load

    threads = args.threads[0] if args.threads else None
    from edgellm import kernels

    with load(model_name, mode=args.mode, threads=threads) as model:
        print(f"kernels: {kernels.describe()}")
        print(profile_decode(model, prompt_tokens=args.prompt_tokens[0]))
    return 0


def resolve_model(name: str):
    from edgellm.store import resolve

    return resolve(name)


def cmd_plan(args: argparse.Namespace) -> int:
    from edgellm.api.planner import plan_file

    from edgellm.entrypoints.cli.generate import lora_specs
    from edgellm.lora.adapter import resident_bytes

    adapters = sum(resident_bytes(path) for path, _ in lora_specs(args).values())
    result = plan_file(resolve_model(args.model), args.memory, want_context=args.context, name=args.model,
                       adapter_bytes=adapters)
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
    rows = [("runtime (Python, libraries)", result.runtime_bytes), ("weights", result.weights_bytes),
            ("tokenizer", result.tokenizer_bytes), ("activation scratch", result.scratch_bytes),
            *([(f"LoRA adapters ({len(args.lora)})", result.adapter_bytes)] if args.lora else []),
            ("safety margin", result.margin_bytes), ("KV cache at that context", result.kv_bytes)]
    for label, value in rows:
        print(f"  {label:<26}{mib(value):>12}")
    print("  KV precision   bytes/token   max context")
    for option in result.options:
        print(f"  {option.precision:<15}{option.bytes_per_token:>11,}   {option.max_context:>11,}")
    for line in result.advice:
        print(f"  note: {line}")
    return 0 if result.fits else 6
