"""`edgellm bench --lora`: what serving adapters costs, in one process taking turns: decode with a
rank-16 adapter on every projection against the base alone, a 4-stream batch under 4 different
adapters against the same batch under one, the RSS three resident adapters add against their
file sizes, and training tokens/s (`edgellm lora train`'s step) on this machine."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
STREAMS = 4


def lora_report(name: str, gen_tokens: int = 128, repeat: int = 3, rank: int = 16, train_steps: int = 6,
                progress: Callable[[str], None] = lambda line: None) -> dict:
    import edgellm
    from edgellm.lora.peft_io import random_adapter

    with tempfile.TemporaryDirectory(prefix="edgellm-bench-lora-") as tmp, edgellm.load(name) as model:
        paths = [random_adapter(Path(tmp) / f"a{i}", model.config, rank=rank, seed=i, std=0.05)
                 for i in range(STREAMS)]
        memory = _resident_memory(model, paths[:3])
        for i, path in enumerate(paths[3:], start=3):
            model.load_adapter(path, f"a{i}")
        single = _single_stream(model, gen_tokens, repeat, progress)
        batch = _batch(model, gen_tokens, repeat, progress)
    training = _training(name, train_steps, rank, progress)
    return {"model": name, "rank": rank, "projections": "q,k,v,o,gate,up,down", "gen_tokens": gen_tokens,
            "repeat": repeat, "decode": single, "batch": batch, "memory": memory, "training": training}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _resident_memory(model, paths: list[Path]) -> dict:
    """RSS before and after making three adapters resident, against their files' sizes."""
    import gc

    gc.collect()
    before = _rss()
    for i, path in enumerate(paths):
        model.load_adapter(path, f"a{i}")
    gc.collect()
    added = _rss() - before
    files = sum(f.stat().st_size for p in paths for f in p.iterdir())
    return {"adapters": len(paths), "rss_added_bytes": added, "file_bytes": files,
            "resident_bytes": sum(a.nbytes for a in model.adapters), "added_over_files": added / files}


def _rate(done) -> float:
    return done.timings.completion_tokens / done.timings.decode_s


def _single_stream(model, gen_tokens: int, repeat: int, progress) -> dict:
    """Decode tok/s of the base and under one adapter, alternating, medians."""
    ids = model.chat_ids(PROMPT)
    runs: dict[str, list[float]] = {"base": [], "adapter": []}
    for which, adapter in (("base", None), ("adapter", "a0")):  # a warm-up of each
        model.generate(ids, max_tokens=16, adapter=adapter)
    for _ in range(repeat):
        for which, adapter in (("base", None), ("adapter", "a0")):
            runs[which].append(_rate(model.generate(ids, max_tokens=gen_tokens, ignore_eos=True, adapter=adapter)))
        progress(f"decode: base {runs['base'][-1]:.1f} tok/s, rank-16 adapter {runs['adapter'][-1]:.1f} tok/s")
    base, adapted = statistics.median(runs["base"]), statistics.median(runs["adapter"])
    return {"base_tokens_per_s": base, "adapter_tokens_per_s": adapted, "ratio": adapted / base}


def _batch(model, gen_tokens: int, repeat: int, progress) -> dict:
    """Aggregate decode tok/s of STREAMS sequences in one batch: 4 different adapters, one
    adapter for all, the base for all (the same prompt, steps timed after the prompts are in)."""
    layouts = {"different": [f"a{i}" for i in range(STREAMS)], "same": ["a0"] * STREAMS, "base": [None] * STREAMS}
    runs: dict[str, list[float]] = {k: [] for k in layouts}
    _batched_rate(model, layouts["different"], 8)  # warm-up
    for _ in range(repeat):
        for kind, adapters in layouts.items():
            runs[kind].append(_batched_rate(model, adapters, gen_tokens))
        progress(f"{STREAMS}-stream batch: different adapters {runs['different'][-1]:.1f} tok/s, one adapter "
                 f"{runs['same'][-1]:.1f}, base {runs['base'][-1]:.1f}")
    medians = {f"{k}_tokens_per_s": statistics.median(v) for k, v in runs.items()}
    return medians | {"streams": STREAMS,
                      "different_over_same": medians["different_tokens_per_s"] / medians["same_tokens_per_s"]}


def _batched_rate(model, adapters: list[str | None], steps: int) -> float:
    import torch

    from edgellm.generation.passes import decode_step

    ids = model.chat_ids(PROMPT)
    generations = [model.generation(ids, adapter=a, max_tokens=steps + 1, ignore_eos=True) for a in adapters]
    try:
        with torch.inference_mode():
            for g in generations:
                g.accept(g.prefill())
            start, tokens = time.perf_counter(), 0
            while not any(g.done for g in generations):
                for g, logits in zip(generations, decode_step(model.net, generations)):
                    g.accept(logits)
                tokens += len(generations)
            return tokens / (time.perf_counter() - start)
    finally:
        for g in generations:
            g.close()


def _training(name: str, steps: int, rank: int, progress) -> dict:
    """Tokens/s of `edgellm lora train`'s optimizer steps (forward + backward + AdamW) on chat
    examples of ~100 tokens, the first step (warm-up) left out."""
    import edgellm
    from edgellm.lora.train import LoRATrainer, TrainConfig, chat_example

    with edgellm.load(name, mode="exact") as model:
        text = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 3
        examples = [chat_example(model.template, [{"role": "user", "content": f"Tell me story {i}."},
                                                  {"role": "assistant", "content": text}], 512) for i in range(2)]
        trainer = LoRATrainer(model, TrainConfig(rank=rank, batch=2))
        trainer.step(examples)
        start, tokens = time.perf_counter(), 0
        for _ in range(steps):
            trainer.step(examples)
            tokens += sum(len(e.ids) for e in examples)
        rate = tokens / (time.perf_counter() - start)
    progress(f"training: {rate:.0f} tokens/s (rank {rank}, all projections)")
    return {"tokens_per_s": rate, "tokens_per_example": len(examples[0].ids), "steps": steps,
            "base": "exact (fp32 values of the file's weights)"}


def format_lora(r: dict) -> str:
    d, b, m, t = r["decode"], r["batch"], r["memory"], r["training"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    return "\n".join([
        f"LoRA on {r['model']}: rank {r['rank']} on {r['projections']}, {r['gen_tokens']} tokens, medians of "
        f"{r['repeat']} rounds",
        f"  decode, one stream:  base {d['base_tokens_per_s']:.1f} tok/s, with the adapter "
        f"{d['adapter_tokens_per_s']:.1f} tok/s = {d['ratio']:.2f}x (target >= 0.90)",
        f"  {b['streams']}-stream batch:      {b['streams']} different adapters {b['different_tokens_per_s']:.1f} tok/s, "
        f"one adapter {b['same_tokens_per_s']:.1f}, base {b['base_tokens_per_s']:.1f}: different / one = "
        f"{b['different_over_same']:.2f}x (target >= 0.85)",
        f"  memory:              {m['adapters']} resident adapters add {mib(m['rss_added_bytes'])} RSS; their files "
        f"{mib(m['file_bytes'])} ({m['added_over_files']:.2f}x, target <= 1); held as int8 {mib(m['resident_bytes'])}",
        f"  training:            {t['tokens_per_s']:.0f} tokens/s ({t['tokens_per_example']}-token examples, "
        f"forward + backward + AdamW)",
    ])
