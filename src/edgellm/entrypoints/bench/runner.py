"""`edgellm bench`: each engine in a fresh process per (model, threads), medians over repeats,
ratios against llama.cpp on the same GGUF file in the same run.

With several rounds the engines take turns (a process each per round) and their runs are
pooled: on a shared machine whose speed drifts for minutes at a time, both engines then meet
the same slow and fast phases, so the ratios are steadier than either engine's numbers."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec

from edgellm.errors import EdgeLLMError
from edgellm.store import resolve


@dataclass
class BenchConfig:
    models: list[str]
    threads: list[int]
    prompt_tokens: list[int] = field(default_factory=lambda: [128, 512])
    gen_tokens: int = 128
    repeat: int = 3
    rounds: int = 1
    mode: str = "fast"
    llama_cpp: bool = True  # compare when llama-cpp-python is installed


def llama_cpp_available() -> bool:
    return find_spec("llama_cpp") is not None


def spawn_worker(cfg: dict, threads: int) -> dict:
    """Run entrypoints/bench/worker.py for one engine and config; its raw timings, with the cold start."""
    # OMP_NUM_THREADS must be in the environment before torch is imported: torch sizes its
    # OpenMP team once, at import, and a team wider than the cores given slows every GEMM.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-m", "edgellm.entrypoints.bench.worker", json.dumps(cfg)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise EdgeLLMError(f"{cfg['engine']} worker failed: {proc.stderr.strip().splitlines()[-1:]}")
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    raw["cold_start_s"] = raw.pop("first_token_epoch") - spawned
    return raw


def _summarize(raws: list[dict], gen: int) -> dict:
    """Medians over every round's repeats of TTFT, prefill and decode speed, per prompt length;
    medians of load and cold start; the highest peak RSS."""
    by_prompt = {}
    for n in raws[0]["runs"]:
        runs = [r for raw in raws for r in raw["runs"][n]]
        ttft = statistics.median(r["ttft_s"] for r in runs)
        decode = statistics.median((r["generated"] - 1) / r["decode_s"] for r in runs if r["decode_s"] > 0)
        by_prompt[n] = dict(ttft_s=ttft, prefill_tok_s=int(n) / ttft, decode_tok_s=decode)
    peak = max(raws, key=lambda raw: raw["peak_rss_bytes"])
    kernels = {"kernels": raws[0]["kernels"]} if "kernels" in raws[0] else {}
    return kernels | dict(load_s=statistics.median(raw["load_s"] for raw in raws),
                cold_start_s=statistics.median(raw["cold_start_s"] for raw in raws),
                peak_rss_mb=peak["peak_rss_bytes"] / 2**20, runtime_rss_mb=peak["runtime_rss_bytes"] / 2**20,
                by_prompt=by_prompt)


def _ratios(ours: dict, theirs: dict) -> dict:
    out = {}
    for n, o in ours["by_prompt"].items():
        t = theirs["by_prompt"][n]
        out[n] = dict(prefill=o["prefill_tok_s"] / t["prefill_tok_s"], decode=o["decode_tok_s"] / t["decode_tok_s"],
                      ttft=o["ttft_s"] / t["ttft_s"])
    out["rss_above_runtime_vs_their_peak"] = (ours["peak_rss_mb"] - ours["runtime_rss_mb"]) / theirs["peak_rss_mb"]
    return out


def run_bench(config: BenchConfig, progress=print) -> dict:
    engines = ["edgellm"] + (["llama.cpp"] if config.llama_cpp and llama_cpp_available() else [])
    results = []
    for model in config.models:
        path = str(resolve(model))
        for threads in config.threads:
            entry = dict(model=model, path=path, threads=threads, engines={})
            raws: dict[str, list[dict]] = {engine: [] for engine in engines}
            for round_ in range(1, config.rounds + 1):
                for engine in engines:
                    progress(f"{model} · {threads} threads · {engine} · round {round_}/{config.rounds} ...")
                    cfg = dict(engine=engine, path=path, threads=threads, prompt_tokens=config.prompt_tokens,
                               gen_tokens=config.gen_tokens, repeat=config.repeat, mode=config.mode)
                    raws[engine].append(spawn_worker(cfg, threads))
            for engine in engines:
                entry["engines"][engine] = _summarize(raws[engine], config.gen_tokens)
            if "llama.cpp" in entry["engines"]:
                entry["ratio_vs_llama_cpp"] = _ratios(entry["engines"]["edgellm"], entry["engines"]["llama.cpp"])
            results.append(entry)
    return dict(config=config.__dict__, results=results)


def format_table(report: dict) -> str:
    lines = []
    for entry in report["results"]:
        kernels = entry["engines"].get("edgellm", {}).get("kernels")
        lines.append(f"\n{entry['model']} — {entry['threads']} threads" + (f" — edgellm: {kernels}" if kernels else ""))
        lines.append(f"{'engine':<11}{'prompt':>7}{'TTFT ms':>9}{'prefill t/s':>12}{'decode t/s':>11}"
                     f"{'load s':>8}{'cold s':>8}{'peak MB':>9}")
        for name, e in entry["engines"].items():
            for n, m in e["by_prompt"].items():
                lines.append(f"{name:<11}{n:>7}{m['ttft_s'] * 1000:>9.0f}{m['prefill_tok_s']:>12.0f}"
                             f"{m['decode_tok_s']:>11.1f}{e['load_s']:>8.2f}{e['cold_start_s']:>8.2f}{e['peak_rss_mb']:>9.0f}")
        ratio = entry.get("ratio_vs_llama_cpp")
        if ratio:
            for n, r in ratio.items():
                if isinstance(r, dict):
                    lines.append(f"{'ratio':<11}{n:>7}{r['ttft']:>9.2f}{r['prefill']:>12.2f}{r['decode']:>11.2f}")
            ours = entry["engines"]["edgellm"]
            lines.append(f"edgellm RSS above its runtime ({ours['runtime_rss_mb']:.0f} MB): "
                         f"{ours['peak_rss_mb'] - ours['runtime_rss_mb']:.0f} MB = "
                         f"{ratio['rss_above_runtime_vs_their_peak']:.2f}× llama.cpp's peak")
    return "\n".join(lines)
