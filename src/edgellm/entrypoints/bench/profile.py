"""Where decode time goes, per op type (torch.profiler over a run of decode steps)."""
from __future__ import annotations

import torch


def profile_decode(model, prompt_tokens: int = 128, steps: int = 32, rows: int = 20) -> str:
    from edgellm.entrypoints.bench.engines import bench_prompt
    from edgellm.generation.sampling import greedy
    from edgellm.kv import fresh_sequence

    ids = bench_prompt(model.tokenizer, prompt_tokens)
    caches = fresh_sequence(model.net)
    net = model.net
    with torch.inference_mode():
        token = greedy(net(torch.tensor([ids]), caches, last_only=True)[0, -1])
        for _ in range(4):  # warm up allocator and kernels
            token = greedy(net(torch.tensor([[token]]), caches, last_only=True)[0, -1])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                token = greedy(net(torch.tensor([[token]]), caches, last_only=True)[0, -1])
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    total_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / steps
    ops = sum(e.count for e in prof.key_averages()) / steps
    return f"{table}\nper decode step: {total_ms:.2f} ms of op time, {ops:.0f} op calls"
