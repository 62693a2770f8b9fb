"""`edgellm bench --store`: what managing models costs. Pull throughput: each model's file served by
an HTTP server on 127.0.0.1 and pulled into an empty store (download, then the SHA-256 and GGUF
checks). Hot swap: a server's model id moved to each model in turn through the router, the time
split into load, canary (the warm-up request through the new version's service) and switch."""
from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from edgellm.store import Store, pull, resolve


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def pull_throughput(models: list[str], repeat: int, progress: Callable[[str], None]) -> list[dict]:
    """Per model: seconds and MB/s of `repeat` pulls from a local HTTP server into a fresh store."""
    with tempfile.TemporaryDirectory() as served:
        for name in models:
            shutil.copy(resolve(name), Path(served) / f"{name}.gguf")
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=served))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            return [_pulls(name, f"http://127.0.0.1:{httpd.server_address[1]}/{name}.gguf", repeat, progress)
                    for name in models]
        finally:
            httpd.shutdown()
            httpd.server_close()


def _pulls(name: str, url: str, repeat: int, progress: Callable[[str], None]) -> dict:
    runs = []
    for i in range(repeat):
        progress(f"pulling {name} ({i + 1}/{repeat}) ...")
        stages: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            manifest = pull(url, name="bench", store=Store(root),
                            progress=lambda stage, done, total: stages.setdefault(stage, time.perf_counter()))
            runs.append((time.perf_counter() - start, stages.get("verifying", start) - start, manifest.size))
    seconds = statistics.median(r[0] for r in runs)
    size = runs[0][2]
    return dict(model=name, bytes=size, seconds=round(seconds, 3),
                download_s=round(statistics.median(r[1] for r in runs), 3),
                mb_per_s=round(size / seconds / 1e6, 1), runs=[round(r[0], 3) for r in runs])


def swap_times(models: list[str], repeat: int, threads: int | None, progress: Callable[[str], None]) -> list[dict]:
    """Per model: the median load / canary / switch seconds of swapping a served id to it `repeat`
    times (from the other models in turn)."""
    from edgellm.api.loader import load
    from edgellm.serving.router import Router
    from edgellm.serving.service import Service

    router = Router({"served": models[-1]}, lambda ref, budget: load(ref, threads=threads),
                    lambda model: Service(model, start=False))
    timings: dict[str, list[dict]] = {name: [] for name in models}
    try:
        router.release(router.acquire("served"))
        for i in range(repeat):
            for name in models:
                progress(f"swapping to {name} ({i + 1}/{repeat}) ...")
                timings[name].append(router.swap("served", name))
    finally:
        router.close()
    return [dict(model=name, **{key: round(statistics.median(t[key] for t in runs), 4)
                                for key in ("load_s", "canary_s", "switch_s")}) for name, runs in timings.items()]


def store_report(models: list[str], repeat: int, threads: int | None, progress: Callable[[str], None]) -> dict:
    return dict(pull=pull_throughput(models, repeat, progress), swap=swap_times(models, repeat, threads, progress),
                repeat=repeat)


def format_store(report: dict) -> str:
    lines = ["pull from 127.0.0.1 into an empty store (download, SHA-256, GGUF check):"]
    for p in report["pull"]:
        lines.append(f"  {p['model']:<16} {p['bytes'] / 2**20:8.1f} MiB  {p['seconds']:6.2f} s  "
                     f"({p['download_s']:.2f} s download)  {p['mb_per_s']:7.1f} MB/s")
    lines.append("hot swap (load beside the old version, canary request, switch):")
    for s in report["swap"]:
        lines.append(f"  {s['model']:<16} load {s['load_s']:6.3f} s  canary {s['canary_s']:6.3f} s  "
                     f"switch {s['switch_s'] * 1e3:7.3f} ms")
    return "\n".join(lines)
