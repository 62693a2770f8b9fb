"""Aggregate decode throughput of the service with 1, 2, 4 concurrent streams, in throughput
mode (continuous batching) against latency mode (one at a time)."""
from __future__ import annotations

import threading
import time

from edgellm.generate import Completion


def throughput(model_name: str = "smollm2-135m", streams=(1, 2, 4), tokens: int = 64) -> dict:
    import edgellm
    from edgellm.service import Request, Service

    model = edgellm.load(model_name)  # no generation in this thread: see Service.run_forever
    results = {}
    for mode in ("latency", "throughput"):
        for n in streams:
            service = Service(model, mode=mode, max_batch=4, queue_limit=8)
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
            results[f"{mode}/{n}"] = dict(streams=n, tokens=generated, seconds=round(elapsed, 2),
                                          aggregate_tok_s=round(generated / elapsed, 1))
    model.close()
    return results
