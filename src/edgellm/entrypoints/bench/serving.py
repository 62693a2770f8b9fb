"""The service under load: aggregate decode throughput with 1, 2, 4 concurrent streams in
throughput mode (continuous batching) against latency mode (one at a time), and a running
stream's inter-token gaps while a long prompt arrives (chunked prefill between its steps)."""
from __future__ import annotations

import statistics
import threading
import time

from edgellm.generation import Completion


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
    from edgellm.serving.service import Request, Service

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


def interleaving(model_name: str = "smollm2-135m", prompt_tokens: int = 2000, stream_tokens: int = 300,
                 rounds: int = 3, budget=None) -> dict:
    """A stream decodes; after 20 of its tokens a `prompt_tokens` prompt arrives. The stream's
    inter-token gaps (median, p99, max) over its whole run, and over the newcomer's prefill."""
    import edgellm
    from edgellm.entrypoints.bench.engines import bench_prompt
    from edgellm.generation import TokenEvent
    from edgellm.serving.scheduler import StepBudget
    from edgellm.serving.service import Request, Service

    budget = budget or StepBudget()

    model = edgellm.load(model_name)
    prompt = bench_prompt(model.tokenizer, prompt_tokens)
    runs = []
    for r in range(rounds):
        model.kv.forget_prefixes()
        service = Service(model, max_batch=4, queue_limit=4, step_budget=budget)
        stream = service.submit(Request(f"{r}: 1, 2, 3,", {"max_tokens": stream_tokens, "ignore_eos": True},
                                        timeout_s=600))
        times, newcomer = [], None
        for event in stream:
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
                if len(times) == 20:
                    newcomer = service.submit(Request(prompt, {"max_tokens": 1}, timeout_s=600))
                    arrived = time.perf_counter()
        first_token = arrived + next(e for e in newcomer if isinstance(e, Completion)).timings.ttft_s
        service.close()
        gaps = [b - a for a, b in zip(times, times[1:])]
        during = [b - a for a, b in zip(times, times[1:]) if arrived <= b <= first_token]
        runs.append(dict(median_gap_s=statistics.median(gaps), p99_gap_s=_percentile(gaps, 0.99), max_gap_s=max(gaps),
                         median_gap_during_prefill_s=statistics.median(during) if during else None,
                         newcomer_ttft_s=first_token - arrived))
    model.close()
    summary = {k: statistics.median(run[k] for run in runs) for k in runs[0] if runs[0][k] is not None}
    summary["p99_vs_median"] = round(summary["p99_gap_s"] / summary["median_gap_s"], 2)
    return dict(model=model_name, prompt_tokens=prompt_tokens, stream_tokens=stream_tokens, rounds=rounds,
                interleaved_prompt=budget.interleaved_prompt, **summary)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
