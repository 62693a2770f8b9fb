"""One engine, one model, one thread count, in a process of its own:
`python -m edgellm.entrypoints.bench.worker '<json config>'` prints one JSON line of raw timings."""
from __future__ import annotations

import json
import resource
import sys
import time

import psutil


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    """This process's own high-water mark: Linux's VmHWM belongs to the address space exec made. (ru_maxrss
    survives fork and exec: a worker spawned by a parent that had held 1 GiB reported the parent's peak.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _engine(cfg: dict):
    from edgellm.entrypoints.bench.engines import EdgeEngine, LlamaCppEngine

    if cfg["engine"] == "llama.cpp":
        return LlamaCppEngine(cfg["path"], cfg["threads"], n_ctx=max(cfg["prompt_tokens"]) + cfg["gen_tokens"] + 8,
                              kv=cfg.get("kv"))
    return EdgeEngine(cfg["path"], cfg["threads"], cfg.get("mode", "fast"), kv=cfg.get("kv"))


def measure(cfg: dict) -> dict:
    if cfg["engine"] == "edgellm":
        from edgellm.extras import has_torch

        if has_torch():  # where torch is installed, a long prompt's layers import it: part of the baseline
            import torch  # noqa: F401
    baseline = _rss()
    start = time.perf_counter()
    engine = _engine(cfg)
    load_s = time.perf_counter() - start
    from edgellm.entrypoints.bench.engines import bench_text, prompt_of

    text_tokens = engine.tokens(bench_text())
    runs: dict[str, list[dict]] = {}
    first_token_epoch = None
    for n in cfg["prompt_tokens"]:
        ids = prompt_of(text_tokens, n)
        runs[str(n)] = []
        for _ in range(cfg["repeat"]):
            t0 = time.time()
            timing = engine.run(ids, cfg["gen_tokens"])
            first_token_epoch = first_token_epoch or t0 + timing.ttft_s
            runs[str(n)].append(dict(ttft_s=timing.ttft_s, decode_s=timing.decode_s, generated=timing.generated))
    out = dict(engine=cfg["engine"], load_s=load_s, runtime_rss_bytes=baseline, peak_rss_bytes=_peak_rss(),
               first_token_epoch=first_token_epoch, runs=runs)
    if cfg["engine"] == "edgellm":
        from edgellm import kernels

        out["kernels"] = kernels.describe()
    return out


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
