"""`edgellm bench --quant SRC --recipes a,b,...`: the size / quality / speed trade-off of each
recipe on one float model, as a table, JSON and a plot of quality against bytes.

Per recipe: quantize (tools/quantize.py), evaluate against the source in exact arithmetic
(tools/evaluate.py: perplexity, KL, top-1 on the held-out text), then decode speed in fast mode
(median of 3 greedy runs of 64 tokens after a 128-token prompt). A recipe ending in "+awq"
is calibrated on the built-in calibration text."""
from __future__ import annotations

import statistics
from importlib import resources
from pathlib import Path
from typing import Callable

from edgellm.entrypoints.bench.engines import bench_prompt
from edgellm.entrypoints.bench.plot import pyplot, save

DECODE_TOKENS, PROMPT_TOKENS, REPEAT = 64, 128, 3


def calibration_file() -> str:
    return str(resources.files("edgellm").joinpath("data/calibration.txt"))


def decode_speed(path: str | Path) -> float:
    import edgellm

    with edgellm.load(path, mode="fast") as model:
        ids = bench_prompt(model.tokenizer, PROMPT_TOKENS)
        model.generate(ids, max_tokens=8, ignore_eos=True)  # warm the kernels
        runs = [model.generate(ids, max_tokens=DECODE_TOKENS, ignore_eos=True).timings.decode_tokens_per_s
                for _ in range(REPEAT)]
    return statistics.median(runs)


def quant_sweep(source: str, recipes: list[str], out_dir: str | Path,
                progress: Callable[[str], None] = print) -> dict:
    import edgellm
    from edgellm.tools.evaluate import evaluate
    from edgellm.tools.quantize import quantize_model

    out_dir = Path(out_dir)
    results = []
    with edgellm.load(source, mode="exact") as reference:
        progress(f"{source}: source (float)")
        base = evaluate(reference, reference)
        results.append({"recipe": "source", "file_bytes": reference.info.file_bytes, **base.as_dict(),
                        "decode_tok_s": decode_speed(source)})
        for recipe in recipes:
            rules, awq = recipe.removesuffix("+awq"), recipe.endswith("+awq")
            progress(f"{source}: {recipe}")
            target = out_dir / f"{Path(source).name}-{recipe.replace(':', '_').replace(' ', '')}.edgellm"
            made = quantize_model(source, target, rules, calibrate=calibration_file() if awq else None)
            with edgellm.load(made.path, mode="exact") as model:
                quality = evaluate(model, reference)
            results.append({"recipe": recipe, "file_bytes": made.file_bytes, **quality.as_dict(),
                            "decode_tok_s": decode_speed(made.path), "awq_error_ratio": made.awq_error_ratio})
    return {"source": str(source), "results": results}


def format_quant_table(report: dict) -> str:
    lines = [f"source: {report['source']}",
             "| recipe | file MiB | bits/weight | PPL | KL mean | KL p99 | top-1 % | decode tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['recipe']} | {r['file_bytes'] / 2**20:.1f} | {r['bits_per_weight']:.2f} | "
                     f"{r['perplexity']:.3f} | {r['kl_mean']:.4f} | {r['kl_p99']:.4f} | "
                     f"{100 * r['top1_agreement']:.1f} | {r['decode_tok_s']:.1f} |")
    return "\n".join(lines)


def plot_quant(reports: list[dict], path: str | Path) -> Path:
    """KL against bits per weight, one panel per source model."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 4.5), squeeze=False)
    for ax, report in zip(axes[0], reports):
        rows = [r for r in report["results"] if r["recipe"] != "source"]
        for r in rows:
            ax.scatter(r["bits_per_weight"], max(r["kl_mean"], 1e-6), s=40)
            ax.annotate(r["recipe"], (r["bits_per_weight"], max(r["kl_mean"], 1e-6)), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (2-D weights, as stored)")
        ax.set_ylabel("mean KL vs float source (lower is better)")
        ax.set_title(Path(report["source"]).name)
        ax.grid(alpha=0.3)
    return save(fig, path)
