"""Aggregate decode throughput of the service with 1, 2, 4 concurrent streams, in throughput
mode (continuous batching) against latency mode (one at a time)."""
from __future__ import annotations

import statistics
import threading
import time

from edgellm.generate import Completion


def throughput(model_name: str = "smollm2-135m", streams=(1, 2, 4), tokens: int = 64, rounds: int = 3) -> dict:
    """Each (mode, streams) configuration `rounds` times, the configurations taking turns so that
    the machine's drift hits them alike; medians, and each one's speedup over one stream in the
    same mode (the median of the per-round ratios)."""
    import edgellm

    model = edgellm.load(model_name)  # no generation in this thread: see Service.run_forever
    runs: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for mode in ("latency", "throughput"):
            for n in streams:
                runs.setdefault(f"{mode}/{n}", []).append(_run(model, mode, n, tokens))
    model.close()
    results = {}
    for key, measured in runs.items():
        mode, n = key.split("/")
        single = runs[f"{mode}/{streams[0]}"]
        results[key] = dict(streams=int(n), tokens=measured[0]["tokens"], rounds=rounds,
                            aggregate_tok_s=statistics.median(r["aggregate_tok_s"] for r in measured),
                            vs_one_stream=round(statistics.median(r["aggregate_tok_s"] / s["aggregate_tok_s"]
                                                                  for r, s in zip(measured, single)), 2))
    return results


def _run(model, mode: str, n: int, tokens: int) -> dict:
    from edgellm.service import Request, Service

    service = Service(model, max_batch=4 if mode == "throughput" else 1, queue_limit=8)
    for _ in service.submit(Request("warm up", {"max_tokens": 4})):
        pass
    done: list[Completion] = []

    def run(i: int) -> None:
        handle = service.submit(Request(f"Story number {i}: once upon a time",
                                        {"max_tokens": tokens, "ignore_eos": True, "temperature": 0},
                                        timeout_s=600))
        done.extend(e for e in handle if isinstance(e, Completion))

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    service.close()
    generated = sum(len(c.token_ids) for c in done)
    return dict(tokens=generated, seconds=round(elapsed, 2), aggregate_tok_s=round(generated / elapsed, 1))
