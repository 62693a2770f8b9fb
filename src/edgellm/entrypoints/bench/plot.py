"""PNG of a bench report: speed against prompt length, and against threads when several."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the Agg backend: the bench plots are files, no display is opened."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> Path:
    """Lay `fig` out, write it to `path` (PNG) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)


def plot_report(report: dict, path: str | Path) -> Path:
    plt = pyplot()
    results = report["results"]
    models = list(dict.fromkeys(r["model"] for r in results))
    threads = sorted({r["threads"] for r in results})
    cols = 2 if len(threads) > 1 else 1
    fig, axes = plt.subplots(len(models), cols, figsize=(6.5 * cols, 4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        entries = [r for r in results if r["model"] == model]
        _by_prompt(axes[row][0], max(entries, key=lambda r: r["threads"]), model)
        if cols == 2:
            _by_threads(axes[row][1], entries, model)
    return save(fig, path)


def _by_prompt(ax, entry: dict, model: str) -> None:
    for engine, e in entry["engines"].items():
        lengths = [int(n) for n in e["by_prompt"]]
        ax.plot(lengths, [m["prefill_tok_s"] for m in e["by_prompt"].values()], "o-", label=f"{engine} prefill")
        ax.plot(lengths, [m["decode_tok_s"] for m in e["by_prompt"].values()], "s--", label=f"{engine} decode")
    ax.set(title=f"{model}, {entry['threads']} threads", xlabel="prompt tokens", ylabel="tokens/s", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _by_threads(ax, entries: list[dict], model: str) -> None:
    engines = entries[0]["engines"].keys()
    first_len = next(iter(entries[0]["engines"]["edgellm"]["by_prompt"]))
    for engine in engines:
        xs = [r["threads"] for r in entries]
        ax.plot(xs, [r["engines"][engine]["by_prompt"][first_len]["decode_tok_s"] for r in entries], "s--",
                label=f"{engine} decode")
        ax.plot(xs, [r["engines"][engine]["by_prompt"][first_len]["prefill_tok_s"] for r in entries], "o-",
                label=f"{engine} prefill")
    ax.set(title=f"{model}, prompt {first_len}", xlabel="threads", ylabel="tokens/s", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
