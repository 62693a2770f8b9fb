"""`edgellm convert | quantize | eval`: HF folders out, quantized files out, quality measured."""
from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from typing import Iterator

from edgellm.quant.builtin_recipes import BUILTIN


@contextmanager
def progress_bar(enabled: bool = True) -> Iterator:
    """A rich progress bar on stderr; yields a (stage, done, total) callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        yield report


def cmd_convert(args: argparse.Namespace) -> int:
    from edgellm.tools.convert import convert_to_hf

    with progress_bar(not args.quiet) as report:
        out = convert_to_hf(args.model, args.out, args.dtype,
                            progress=(lambda name, done, total: report("convert", done, total)) if report else None)
    print(f"wrote {out} (Hugging Face layout, {args.dtype})")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from edgellm.tools.quantize import quantize_model

    with progress_bar(not args.quiet) as report:
        result = quantize_model(args.src, args.out, args.recipe, calibrate=args.calibrate, progress=report)
    report_dict = result.as_dict()
    if not args.no_eval:
        quality = _evaluate(str(result.path), args.src, args.text, args.mode)
        report_dict["quality"] = quality.as_dict()
    if args.json:
        print(json.dumps(report_dict, indent=2))
        return 0
    schemes = ", ".join(f"{k}×{v}" for k, v in result.schemes.items())
    print(f"wrote {result.path}: {result.file_bytes / 2**20:.1f} MiB, recipe {result.recipe!r} ({schemes})")
    if result.regrouped:
        print(f"  {len(result.regrouped)} weights took a smaller group (K not a multiple of the recipe's)")
    if result.awq_error_ratio is not None:
        print(f"  AWQ: calibration error ×{result.awq_error_ratio:.3f} of plain rounding")
    if not args.no_eval:
        _print_quality(quality)
        print(f"verdict: {_verdict(quality)}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    quality = _evaluate(args.model, args.reference, args.text, args.mode)
    if args.json:
        print(json.dumps(quality.as_dict(), indent=2))
    else:
        _print_quality(quality)
    return 0


def _evaluate(model: str, reference: str | None, text_file: str | None, mode: str):
    from pathlib import Path

    from edgellm.tools.evaluate import evaluate
    from edgellm.api.loader import load

    text = Path(text_file).read_text(encoding="utf-8") if text_file else None
    with load(model, mode=mode) as m:
        if reference is None:
            return evaluate(m, None, text)
        with load(reference, mode=mode) as ref:
            return evaluate(m, ref, text)


def _print_quality(quality) -> None:
    for key, value in quality.rows():
        print(f"{key:>22}  {value}")


def _verdict(q) -> str:
    """A one-line judgement; thresholds from docs/quantization.md's measurements."""
    if q.kl_mean is None:
        return "no reference to compare against"
    if q.kl_mean <= 0.01:
        return f"good (KL {q.kl_mean:.4f} ≤ 0.01)"
    if q.kl_mean <= 0.1:
        return f"usable, measurably degraded (KL {q.kl_mean:.3f})"
    return f"poor: KL {q.kl_mean:.2f} — try a mixed recipe, a smaller group, asymmetric INT4 or --calibrate"


def add_parsers(sub) -> None:
    convert = sub.add_parser("convert", help="write a model as a Hugging Face folder (safetensors)")
    convert.add_argument("model", help="registered name, .gguf, HF folder or edgellm quantized file")
    convert.add_argument("--to", choices=("hf",), default="hf")
    convert.add_argument("out", help="output folder (must not exist, or be empty)")
    convert.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16")
    convert.add_argument("-q", "--quiet", action="store_true")
    convert.set_defaults(func=cmd_convert)

    quant = sub.add_parser("quantize", help="quantize a float model (HF folder or GGUF) by a recipe, then evaluate it")
    quant.add_argument("src")
    quant.add_argument("out")
    quant.add_argument("--recipe", default="int8",
                       help=f"built-in ({', '.join(BUILTIN)}) or rules like 'q_proj,k_proj,v_proj: int8; *: int4-g64'")
    quant.add_argument("--calibrate", metavar="FILE", default=None, help="text for activation-aware (AWQ) scaling")
    quant.add_argument("--text", metavar="FILE", default=None, help="evaluation text (default: built-in held-out)")
    quant.add_argument("--mode", choices=("exact", "fast"), default="exact",
                       help="arithmetic for the evaluation (exact isolates the quantization error)")
    quant.add_argument("--no-eval", action="store_true", help="skip the quality check")
    quant.add_argument("--json", action="store_true")
    quant.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=cmd_quantize)

    ev = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement against a reference")
    ev.add_argument("model")
    ev.add_argument("--reference", default=None, help="the model to compare against (e.g. the float source)")
    ev.add_argument("--text", metavar="FILE", default=None, help="evaluation text (default: built-in held-out)")
    ev.add_argument("--mode", choices=("exact", "fast"), default="exact")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)
