"""`edgellm bench --serve-memory N`: whether a server's memory is accounted for. A default `edgellm
serve` answers N distinct chat prompts one at a time; every `every` requests its RSS and the budgets it
reports (`edgellm_kv_bytes`, the KV pool's blocks, and of those `edgellm_prefix_cache_bytes`, the ones
kept for prefix reuse) are read. The prefix cache fills as prompts arrive and then stays at its budget,
so RSS should grow by what the KV gauge says and no more."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable

import psutil

GAUGES = ("edgellm_prefix_cache_bytes", "edgellm_kv_bytes")
MIB = 2 ** 20


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(base: str) -> dict[str, float]:
    """The sum of each gauge's samples (all label sets) on /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    sums = {name: 0.0 for name in GAUGES}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in sums:
            sums[name] += float(line.split()[-1])
    return sums


def _ready(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"edgellm serve exited with code {server.returncode} before it answered")
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"edgellm serve did not answer within {timeout:.0f} s")


def _prompt(i: int) -> str:
    """A distinct note per request: no two prompts share more than the chat template's opening."""
    return (f"Note {i}: the meeting about project {i * 7919 % 10007} moved to room {i % 97}. "
            f"Summarize it in one line, please, and mention the number {i}.")


def _ask(base: str, model: str, i: int) -> None:
    body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": _prompt(i)}]}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=300).read()


def _sample(i: int, process: psutil.Process, base: str) -> dict:
    gauges = _metrics(base)
    return dict(requests=i, rss_mib=round(process.memory_info().rss / MIB, 1),
                **{name.removeprefix("edgellm_").replace("_bytes", "_mib"): round(v / MIB, 1)
                   for name, v in gauges.items()})


def serve_memory(model: str, requests: int = 720, every: int = 90, extra_args: list[str] | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> dict:
    """Samples of one server's RSS and gauges over `requests` distinct chat prompts, and the growth
    after the first request against what the gauges grew by."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "edgellm", "serve", "-m", model, "--port", str(port), *(extra_args or [])]
    with tempfile.TemporaryFile() as errors:  # read only on failure: a pipe nobody reads would fill and block it
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=os.environ.copy())
        try:
            _ready(base, server, timeout=300)
            process = psutil.Process(server.pid)
            _ask(base, model, 0)
            samples = [_sample(1, process, base)]
            progress(f"serve-memory {model}: {samples[0]}")
            for i in range(1, requests):
                _ask(base, model, i)
                if (i + 1) % every == 0 or i + 1 == requests:
                    samples.append(_sample(i + 1, process, base))
                    progress(f"serve-memory {model}: {samples[-1]}")
        except Exception:
            errors.seek(0)
            sys.stderr.write(errors.read().decode(errors="replace")[-4000:])
            raise
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    return dict(model=model, requests=requests, samples=samples, **_growth(samples))


def _growth(samples: list[dict]) -> dict:
    first, last = samples[0], samples[-1]
    rss = last["rss_mib"] - first["rss_mib"]
    accounted = last["kv_mib"] - first["kv_mib"]  # the prefix cache's blocks are among the pool's
    return dict(rss_growth_mib=round(rss, 1), accounted_growth_mib=round(accounted, 1),
                unaccounted_mib=round(rss - accounted, 1),
                unaccounted_share=round((rss - accounted) / accounted, 3) if accounted > 0 else None)


def format_serve_memory(report: dict) -> str:
    lines = [f"{report['model']}: {report['requests']} distinct chat prompts, one at a time",
             f"{'requests':>9} {'RSS MiB':>9} {'prefix cache MiB':>17} {'KV MiB':>8}"]
    for s in report["samples"]:
        lines.append(f"{s['requests']:>9} {s['rss_mib']:>9.1f} {s['prefix_cache_mib']:>17.1f} {s['kv_mib']:>8.1f}")
    share = report["unaccounted_share"]
    lines.append(f"RSS grew {report['rss_growth_mib']:.1f} MiB after the first request; the KV pool "
                 f"{report['accounted_growth_mib']:.1f} MiB"
                 + ("" if share is None else f" ({share:+.1%} beyond them)"))
    return "\n".join(lines)
