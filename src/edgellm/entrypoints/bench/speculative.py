"""`edgellm bench --speculative`: decode speed with each drafter against plain decoding of the
same prompts in the same process, taking turns, greedy, and whether the tokens were the same.

* lookup: rewriting two ~500-token documents (the held-out text): the reply copies spans of
  them (the first nearly all, the second where the model does not paraphrase).
* draft: open chat prompts; the draft is the model itself (4-bit), the target a copy of it in
  more bytes: INT8 (`edgellm quantize`) and float32 (`edgellm convert --dtype f32`), both cached.
* self: open chat prompts; the first layers of the model draft. Reported with what decided
  it: how often each early exit agrees with the whole model, and the speedup that predicts."""
from __future__ import annotations

import statistics
from importlib import resources
from pathlib import Path
from typing import Callable

from edgellm.entrypoints.bench.plot import pyplot, save

CHAT_PROMPTS = ["Write a short story about a robot who learns to paint.",
                "Explain why the sky is blue to a ten-year-old.",
                "Give me three tips for a job interview, with one sentence on each."]


def speculative_report(model: str, gen_tokens: int = 128, repeat: int = 3,
                       progress: Callable[[str], None] = lambda line: None) -> dict:
    import edgellm

    text = resources.files("edgellm").joinpath("data/heldout.txt").read_text(encoding="utf-8")
    rewrite = [[{"role": "user", "content": document + "\n\nRewrite the text above, keeping every sentence."}]
               for document in (text[:2200], text[2200:4400])]  # ~500 tokens each
    chats = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
    report: dict = {"model": model, "gen_tokens": gen_tokens, "repeat": repeat, "workloads": {}}
    with edgellm.load(model) as target:
        report["workloads"]["lookup"] = _compare(target, "lookup", rewrite, gen_tokens, repeat, progress)
        report["workloads"]["self"] = _compare(target, "self", chats, gen_tokens, repeat, progress) | {
            "early_exit_agreement": target.self_draft_agreement, "layers": target.config.n_layers}
    for name, copy in (("draft_int8", _int8_copy), ("draft_f32", _f32_copy)):
        path = copy(model, progress)
        with edgellm.load(path, draft=model) as target:
            report["workloads"][name] = _compare(target, "draft", chats, gen_tokens, repeat, progress) | {
                "target": str(path), "draft": model}
    return report


def _compare(model, kind: str, conversations: list, gen_tokens: int, repeat: int, progress) -> dict:
    """Plain and speculative decoding of each conversation, taking turns (in alternating order),
    `repeat` times; per
    conversation the median tok/s of each and their ratio, and the geometric mean of the ratios."""
    runs = [{"plain": [], kind: []} for _ in conversations]
    drafted = accepted = passes = tokens = 0
    for conversation in conversations:  # every run then starts from the cached prompt: where prompt GEMMs are
        model.chat(conversation, max_tokens=1, speculative="off")  # bf16, a fresh prompt's logits differ a little
    same = True
    for round_ in range(repeat):
        for conversation, speeds in zip(conversations, runs):
            # which goes first alternates: on a shared host whose speed drifts within seconds, always
            # measuring plain first leaned every ratio one way
            if round_ % 2 == 0:
                plain = model.chat(conversation, max_tokens=gen_tokens, speculative="off")
                fast = model.chat(conversation, max_tokens=gen_tokens, speculative=kind)
            else:
                fast = model.chat(conversation, max_tokens=gen_tokens, speculative=kind)
                plain = model.chat(conversation, max_tokens=gen_tokens, speculative="off")
            same &= fast.token_ids == plain.token_ids
            speeds["plain"].append(plain.timings.decode_tokens_per_s)
            speeds[kind].append(fast.timings.decode_tokens_per_s)
            t = fast.timings
            drafted, accepted, passes, tokens = (drafted + t.drafted_tokens, accepted + t.accepted_tokens,
                                                 passes + t.target_passes, tokens + t.completion_tokens - 1)
            progress(f"{kind}: plain {plain.timings.decode_tokens_per_s:.1f} tok/s, "
                     f"{kind} {t.decode_tokens_per_s:.1f} tok/s ({t.accepted_tokens}/{t.drafted_tokens} kept)")
    prompts = [{"plain_decode_tokens_per_s": statistics.median(r["plain"]),
                "speculative_decode_tokens_per_s": statistics.median(r[kind]), "runs": r} for r in runs]
    for p in prompts:
        p["speedup"] = p["speculative_decode_tokens_per_s"] / p["plain_decode_tokens_per_s"]
    return {"speedup": statistics.geometric_mean([p["speedup"] for p in prompts]), "same_tokens": same,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "drafted_tokens": drafted,
            "tokens_per_pass": tokens / passes if passes else 1.0, "prompts": prompts}


def _int8_copy(model: str, progress) -> Path:
    """The model quantized to INT8 by `edgellm quantize` (made once, kept in edgellm's cache)."""
    from edgellm.tools.quantize import quantize_model
    from edgellm.registry import cache_dir
    from edgellm.store import resolve

    source = resolve(model)
    out = cache_dir() / "bench" / f"{source.stem}.int8.edgellm"
    if not out.exists():
        progress(f"making an INT8 target from {source.name} ...")
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize_model(source, out, "int8")
    return out


def _f32_copy(model: str, progress) -> Path:
    """The model as a float32 Hugging Face folder (made once, kept in edgellm's cache)."""
    from edgellm.tools.convert import convert_to_hf
    from edgellm.registry import cache_dir
    from edgellm.store import resolve

    source = resolve(model)
    out = cache_dir() / "bench" / f"{source.stem}.f32"
    if not (out / "config.json").exists():
        progress(f"making a float32 target from {source.name} ...")
        convert_to_hf(source, out, dtype="f32")
    return out


def format_speculative(report: dict) -> str:
    lines = [f"speculative decoding on {report['model']} ({report['gen_tokens']} tokens, greedy, medians "
             f"of {report['repeat']} rounds per prompt)",
             f"{'drafter':<8} {'prompt':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8}"]
    for kind, w in report["workloads"].items():
        for i, p in enumerate(w["prompts"], 1):
            lines.append(f"{kind:<8} {i:>6} {p['plain_decode_tokens_per_s']:>12.1f} "
                         f"{p['speculative_decode_tokens_per_s']:>11.1f} {p['speedup']:>7.2f}x")
        lines.append(f"{kind:<8} {'all':>6} {'':>12} {'':>11} {w['speedup']:>7.2f}x  (geometric mean; "
                     f"{w['acceptance_rate']:.0%} of {w['drafted_tokens']} guesses kept, "
                     f"{w['tokens_per_pass']:.2f} tokens per pass, same tokens: {'yes' if w['same_tokens'] else 'NO'})")
    agreement = report["workloads"]["self"]["early_exit_agreement"] or {}
    if agreement:
        lines.append("self: early exit agrees with the whole model at " + ", ".join(
            f"{n}/{report['workloads']['self']['layers']} layers {a:.0%}" for n, a in sorted(agreement.items())))
    return "\n".join(lines)


def plot_speculative(report: dict, path: str | Path) -> Path:
    """PNG: each drafter's speedup over plain decoding per prompt (bars), its share of guesses
    kept and tokens per target pass in the labels; the dashed line is plain decoding."""
    plt = pyplot()
    workloads = report["workloads"]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    x = 0
    ticks, labels = [], []
    for kind, w in workloads.items():
        speedups = [p["speedup"] for p in w["prompts"]]
        xs = [x + i for i in range(len(speedups))]
        ax.bar(xs, speedups, label=f"{kind}: {w['acceptance_rate']:.0%} kept, {w['tokens_per_pass']:.2f} tokens/pass")
        ticks += xs
        labels += [str(i + 1) for i in range(len(speedups))]
        x += len(speedups) + 1
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set(title=f"speculative decoding, {report['model']} ({report['gen_tokens']} tokens, greedy)",
           xlabel="prompt of each drafter's set", ylabel="decode tok/s vs plain")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
