"""`edgellm bench --sizes`: decode, prefill, load, cold start and memory at the sizes people deploy
(0.5B–8B, entrypoints/bench/shapes.py), against llama.cpp on the same files and against the machine's
memory bandwidth.

Decode reads every weight once per token, so at these sizes its ceiling is the read bandwidth
divided by the bytes of weights a token reads; each decode is reported as the fraction of that
bandwidth it uses. The load of a model edgellm has never seen (its pack cache emptied, the file
itself in the page cache) is timed apart from the loads that follow."""
from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import numpy as np

from edgellm.entrypoints.bench.plot import pyplot, save
from edgellm.entrypoints.bench.runner import BenchConfig, llama_cpp_available, run_bench, spawn_worker
from edgellm.entrypoints.bench.shapes import SHAPES, check_names, ensure_model, parameter_count

BANDWIDTH_BYTES = 1 << 30  # far past any last-level cache


def read_bandwidth(threads: int, passes: int = 7) -> dict:
    """GB/s read by `threads` threads at once, each taking the maximum of its share of a 1 GiB
    buffer (numpy's reductions run without the GIL, one SIMD pass over memory): median and best."""
    data = np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32)
    shares = np.array_split(data, threads)
    seconds = []
    for _ in range(passes):
        workers = [threading.Thread(target=np.max, args=(share,)) for share in shares]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds.append(time.perf_counter() - start)
    return dict(threads=threads, median_gb_s=round(data.nbytes / statistics.median(seconds) / 1e9, 1),
                best_gb_s=round(data.nbytes / min(seconds) / 1e9, 1))


def decode_bytes(path: str | Path) -> int:
    """Bytes of weights one decode step reads: every tensor, less an untied token embedding
    (a step reads one row of it); a tied one is the head, read whole."""
    from edgellm.io.gguf import open_gguf

    with open_gguf(path) as f:
        total = sum(info.nbytes for info in f.tensors.values())
        if "output.weight" in f.tensors:
            total -= f.tensors["token_embd.weight"].nbytes
    return total


def first_load(path: str, threads: int, mode: str = "fast") -> dict:
    """edgellm's load and cold start with no pack cache entry for the file: what a user's first
    run of a downloaded model costs."""
    from edgellm.io.pack import cache_path

    cache_path(path, mode).unlink(missing_ok=True)
    raw = spawn_worker(dict(engine="edgellm", path=path, threads=threads, prompt_tokens=[16], gen_tokens=2, repeat=1,
                      mode=mode), threads)
    return dict(load_s=round(raw["load_s"], 3), cold_start_s=round(raw["cold_start_s"], 3))


def sizes_report(shapes: list[str], weight_types: list[str], threads: int, prompt_tokens: list[int],
                 gen_tokens: int = 64, repeat: int = 3, rounds: int = 2, llama_cpp: bool = True,
                 progress=lambda line: None) -> dict:
    """Every (shape, weight type): entrypoints/bench/runner.py's report of both engines, the first load, the
    bytes a decoded token reads and the fraction of the read bandwidth each decode uses."""
    check_names(shapes, weight_types)
    progress(f"measuring read bandwidth at {threads} threads ...")
    bandwidth = read_bandwidth(threads)
    progress(f"read bandwidth: {bandwidth['median_gb_s']} GB/s (median), {bandwidth['best_gb_s']} best")
    results = []
    for name in shapes:
        for weight_type in weight_types:
            path = str(ensure_model(name, weight_type, progress))
            progress(f"{name} {weight_type}: first load ...")
            first = first_load(path, threads)  # and the pack cache the bench's loads then map
            entry = run_bench(BenchConfig(models=[path], threads=[threads], prompt_tokens=prompt_tokens,
                                          gen_tokens=gen_tokens, repeat=repeat, rounds=rounds,
                                          llama_cpp=llama_cpp and llama_cpp_available()),
                              progress)["results"][0] | dict(first_load=first)
            results.append(_with_bandwidth(entry | dict(shape=name, weight_type=weight_type), bandwidth))
    return dict(bandwidth=bandwidth, threads=threads, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                repeat=repeat, rounds=rounds, results=results)


def _with_bandwidth(entry: dict, bandwidth: dict) -> dict:
    """The entry with its sizes and, per engine, the share of the read bandwidth its decode uses
    (decode after the shortest prompt)."""
    shape = SHAPES[entry["shape"]]
    step_bytes = decode_bytes(entry["path"])
    entry |= dict(parameters=parameter_count(shape), file_mb=round(Path(entry["path"]).stat().st_size / 1e6, 1),
                  decode_bytes_mb=round(step_bytes / 1e6, 1),
                  bandwidth_bound_tok_s=round(bandwidth["median_gb_s"] * 1e9 / step_bytes, 1))
    for engine in entry["engines"].values():
        shortest = min(engine["by_prompt"], key=int)
        engine["bandwidth_fraction"] = round(engine["by_prompt"][shortest]["decode_tok_s"] * step_bytes
                                             / (bandwidth["median_gb_s"] * 1e9), 3)
    return entry


def format_sizes(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"read bandwidth {bw['median_gb_s']} GB/s at {bw['threads']} threads (best {bw['best_gb_s']})",
             f"{'model':<15}{'type':<8}{'MB/token':>9}{'decode':>8}{'llama':>7}{'ratio':>7}{'of bw':>7}"
             f"{'prefill ratios':>16}{'load 1st/then':>15}{'llama':>7}{'cold':>6}{'llama':>7}{'peak MB':>9}"]
    for e in report["results"]:
        ours, theirs = e["engines"]["edgellm"], e["engines"].get("llama.cpp")
        shortest = min(ours["by_prompt"], key=int)
        ratios = e.get("ratio_vs_llama_cpp", {})
        prefill = " / ".join(f"{r['prefill']:.2f}" for n, r in ratios.items() if isinstance(r, dict))
        lines.append(
            f"{e['shape']:<15}{e['weight_type']:<8}{e['decode_bytes_mb']:>9.0f}"
            f"{ours['by_prompt'][shortest]['decode_tok_s']:>8.1f}"
            f"{theirs['by_prompt'][shortest]['decode_tok_s'] if theirs else float('nan'):>7.1f}"
            f"{ratios[shortest]['decode'] if theirs else float('nan'):>7.2f}{ours['bandwidth_fraction']:>7.0%}"
            f"{prefill or '-':>16}{e['first_load']['load_s']:>8.2f} /{ours['load_s']:>5.2f}"
            f"{theirs['load_s'] if theirs else float('nan'):>7.2f}{ours['cold_start_s']:>6.2f}"
            f"{theirs['cold_start_s'] if theirs else float('nan'):>7.2f}{ours['peak_rss_mb']:>9.0f}")
    return "\n".join(lines)


def plot_sizes(report: dict, path: str | Path) -> Path:
    """Decode tok/s against the bytes a token reads (log-log), per engine and weight type, with the
    line the read bandwidth draws."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    results = report["results"]
    for engine, marker in (("edgellm", "o"), ("llama.cpp", "s")):
        for weight_type in dict.fromkeys(e["weight_type"] for e in results):
            points = sorted((e["decode_bytes_mb"], _decode(e, engine), e["shape"]) for e in results
                            if e["weight_type"] == weight_type and engine in e["engines"])
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker + ("-" if engine == "edgellm" else "--"),
                        label=f"{engine} {weight_type}")
    for e in results:
        ax.annotate(e["shape"], (e["decode_bytes_mb"], _decode(e, "edgellm")), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    sizes = np.geomspace(min(e["decode_bytes_mb"] for e in results) * 0.8, max(e["decode_bytes_mb"] for e in results) * 1.2)
    gb_s = report["bandwidth"]["median_gb_s"]
    ax.plot(sizes, gb_s * 1e3 / sizes, "k:", label=f"read bandwidth ({gb_s} GB/s)")
    ax.set(xscale="log", yscale="log", xlabel="MB of weights read per token", ylabel="decode tokens/s",
           title=f"decode against model size, {report['threads']} threads")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, path)


def _decode(entry: dict, engine: str) -> float:
    by_prompt = entry["engines"][engine]["by_prompt"]
    return by_prompt[min(by_prompt, key=int)]["decode_tok_s"]
