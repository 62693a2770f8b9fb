"""Decode speed with a long context behind it: `edgellm bench --sizes SHAPE --context 1024,4096,16384`.

Each engine, in a process of its own per (context, KV type), takes a prompt of that many tokens and
then decodes; only the decode is timed, so what it shows is how reading the KV cache slows each
token as the context grows. KV in f16 and int8 (llama.cpp's F16 and Q8_0 caches, with flash
attention, which its quantized V cache needs)."""
from __future__ import annotations

from pathlib import Path

from edgellm.entrypoints.bench.engines import LLAMA_KV_TYPES
from edgellm.entrypoints.bench.plot import pyplot, save
from edgellm.entrypoints.bench.runner import llama_cpp_available, spawn_worker
from edgellm.entrypoints.bench.shapes import check_names, ensure_model

KV_TYPES = tuple(LLAMA_KV_TYPES)


def context_report(path: str, contexts: list[int], threads: int, gen_tokens: int = 32, kv_types=KV_TYPES,
                   engines=("edgellm", "llama.cpp"), progress=lambda line: None) -> list[dict]:
    """Per context length and KV type: each engine's decode tok/s after that many tokens of prompt."""
    rows = []
    for context in contexts:
        for kv in kv_types:
            row = dict(context=context, kv=kv)
            for engine in engines:
                progress(f"{engine}: {context} tokens of context, {kv} KV ...")
                raw = spawn_worker(dict(engine=engine, path=path, threads=threads, prompt_tokens=[context],
                                        gen_tokens=gen_tokens, repeat=1, kv=kv), threads)
                (run,) = raw["runs"][str(context)]
                row[engine] = dict(decode_tok_s=round((run["generated"] - 1) / run["decode_s"], 2),
                                   prefill_tok_s=round(context / run["ttft_s"], 1))
            if len(engines) == 2:
                row["decode_ratio"] = round(row["edgellm"]["decode_tok_s"] / row["llama.cpp"]["decode_tok_s"], 3)
            rows.append(row)
    return rows


def contexts_report(shapes: list[str], weight_types: list[str], contexts: list[int], threads: int,
                    gen_tokens: int = 32, llama_cpp: bool = True, progress=lambda line: None) -> dict:
    """context_report for every (shape, weight type) of entrypoints/bench/shapes.py, its file made first where missing."""
    check_names(shapes, weight_types)
    engines = ("edgellm", "llama.cpp") if llama_cpp and llama_cpp_available() else ("edgellm",)
    results = [dict(shape=shape, weight_type=kind,
                    context=context_report(str(ensure_model(shape, kind, progress)), contexts, threads,
                                           gen_tokens=gen_tokens, engines=engines, progress=progress))
               for shape in shapes for kind in weight_types]
    return dict(threads=threads, gen_tokens=gen_tokens, results=results)


def format_contexts(report: dict) -> str:
    return "\n\n".join(f"{e['shape']} {e['weight_type']}\n{format_context(e['context'])}" for e in report["results"])


def format_context(rows: list[dict]) -> str:
    lines = [f"{'context':>8}{'KV':>6}{'decode tok/s':>14}{'llama.cpp':>11}{'ratio':>7}"]
    for row in rows:
        theirs = row.get("llama.cpp", {}).get("decode_tok_s", float("nan"))
        lines.append(f"{row['context']:>8}{row['kv']:>6}{row['edgellm']['decode_tok_s']:>14.1f}{theirs:>11.1f}"
                     f"{row.get('decode_ratio', float('nan')):>7.2f}")
    return "\n".join(lines)


def plot_context(report: dict, path: str | Path) -> Path:
    """Decode tok/s against context length (log x), per engine and KV type, one panel per model."""
    plt = pyplot()
    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, entry in zip(axes[0], results):
        for engine, style in (("edgellm", "o-"), ("llama.cpp", "s--")):
            for kv in dict.fromkeys(row["kv"] for row in entry["context"]):
                rows = [row for row in entry["context"] if row["kv"] == kv and engine in row]
                if rows:
                    ax.plot([r["context"] for r in rows], [r[engine]["decode_tok_s"] for r in rows], style,
                            label=f"{engine}, {kv} KV")
        ax.set(xscale="log", xlabel="tokens of context", ylabel="decode tokens/s",
               title=f"{entry['shape']} {entry['weight_type']}, {report['threads']} threads")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save(fig, path)
