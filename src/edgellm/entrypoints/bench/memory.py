"""Memory benchmarks: resident memory against context length per KV precision, prefix-cache
TTFT, and a long streaming run through the sliding window."""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

from edgellm.entrypoints.bench.engines import bench_prompt
from edgellm.entrypoints.bench.plot import pyplot, save
from edgellm.memory import rss_bytes, return_freed_heap

CONTEXTS = (10, 100, 512, 1024, 2048, 4096)
PRECISIONS = ("f32", "bf16", "int8", "int4")
DECODE_TOKENS = 32  # generated after each context to time decode against that KV precision


def measure_curve(model_name: str, precision: str, contexts=CONTEXTS, context_length: int | None = None) -> dict:
    """In this process: RSS and KV bytes while one sequence holds each context length
    (context_length: the configured maximum, which must not change any of it), and the decode
    speed of DECODE_TOKENS greedy tokens after that context."""
    import edgellm
    from edgellm.extras import inference
    from edgellm.generation.passes import prefill
    from edgellm.kv import KVConfig

    model = edgellm.load(model_name, kv=KVConfig(k_precision=precision, v_precision=precision, prefix_cache_bytes=0),
                         context_length=context_length)
    with inference():  # first use of each prefill shape builds kernel state: not KV
        for n in contexts:
            seq, _ = model.kv.new_sequence()
            prefill(model.net, seq, bench_prompt(model.tokenizer, n))
            seq.release()
    points = []
    for n in contexts:
        gc.collect()
        return_freed_heap()
        seq, _ = model.kv.new_sequence()
        with inference():
            prefill(model.net, seq, bench_prompt(model.tokenizer, n))
        return_freed_heap()
        point = dict(tokens=n, rss_bytes=rss_bytes(), kv_bytes=seq.nbytes)
        seq.release()
        del seq
        done = model.generate(bench_prompt(model.tokenizer, n), max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
        points.append(dict(point, decode_tokens_per_s=done.timings.decode_tokens_per_s))
    return dict(model=model_name, precision=precision, points=points)


def memory_report(model_name: str, precisions=PRECISIONS, contexts=CONTEXTS, context_length: int | None = None) -> dict:
    """One fresh process per precision, so each curve starts from the same baseline."""
    curves = []
    for precision in precisions:
        code = ("import json,sys; from edgellm.entrypoints.bench.memory import measure_curve; "
                f"print(json.dumps(measure_curve({model_name!r}, {precision!r}, {tuple(contexts)!r}, "
                f"{context_length!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1])
        curves.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return dict(model=model_name, curves=curves, shared_prompt=shared_prompt_kv(model_name))


def shared_prompt_kv(model_name: str, sessions: int = 8, prompt_tokens: int = 1000) -> dict:
    """KV bytes held (sequences and the prefix cache together) by `sessions` conversations that
    share a ~prompt_tokens system prompt, each prefilled and alive, against one such session."""
    import edgellm
    from edgellm.extras import inference

    model = edgellm.load(model_name)  # prefix reuse on, as users meet it
    tokenizer = model.tokenizer
    system = {"role": "system", "content": tokenizer.decode(bench_prompt(tokenizer, prompt_tokens))}
    held = []
    with inference():
        for i in range(sessions):
            generation = model.generation([system, {"role": "user", "content": f"Question {i}?"}], chat=True,
                                          max_tokens=1)
            generation.prefill()
            held.append((generation, model.kv.pool.used_bytes))
    for generation, _ in held:
        generation.close()
    model.close()
    one, all_ = held[0][1], held[-1][1]
    return dict(sessions=sessions, prompt_tokens=prompt_tokens, kv_bytes_one_session=one,
                kv_bytes_all_sessions=all_, ratio=round(all_ / one, 2))


def plot_memory(report: dict, path) -> None:
    plt = pyplot()
    fig, (rss_ax, kv_ax, speed_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    for curve in report["curves"]:
        xs = [p["tokens"] for p in curve["points"]]
        rss_ax.plot(xs, [p["rss_bytes"] / 2**20 for p in curve["points"]], "o-", label=curve["precision"])
        kv_ax.plot(xs, [p["kv_bytes"] / 2**20 for p in curve["points"]], "o-", label=curve["precision"])
        speed_ax.plot(xs, [p["decode_tokens_per_s"] for p in curve["points"]], "o-", label=curve["precision"])
    rss_ax.set(title=f"{report['model']}: resident memory", xlabel="context tokens", ylabel="RSS (MiB)")
    kv_ax.set(title="KV cache held", xlabel="context tokens", ylabel="MiB")
    speed_ax.set(title="decode speed", xlabel="context tokens", ylabel="tokens/s")
    for ax in (rss_ax, kv_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(title="KV precision")
    save(fig, path)


def kv_decode_speed(model_name: str, precisions=("f16", "int8", "int4"), contexts=(128, 1024, 4096),
                    tokens: int = DECODE_TOKENS, rounds: int = 7) -> dict:
    """Decode tok/s after each context for each KV precision, the precisions taking turns in one
    process so that the machine's drift hits all alike: medians of `rounds`, and the median of
    each round's ratio to the first precision. The prompt's KV comes from the prefix cache after
    the first round, so a round costs its decode only."""
    import statistics

    import edgellm
    from edgellm.kv import KVConfig

    models = {p: edgellm.load(model_name, kv=KVConfig(k_precision=p, v_precision=p, prefix_cache_bytes=256 * 2**20))
              for p in precisions}
    points = []
    for n in contexts:
        prompt = bench_prompt(models[precisions[0]].tokenizer, n)
        speeds = {p: [] for p in precisions}
        for _ in range(rounds + 1):  # the first round fills the prefix caches
            for p, model in models.items():
                done = model.generate(prompt, max_tokens=tokens + 1, ignore_eos=True)
                speeds[p].append(done.timings.decode_tokens_per_s)
        base = speeds[precisions[0]][1:]
        points.append(dict(tokens=n, decode_tokens_per_s={p: statistics.median(v[1:]) for p, v in speeds.items()},
                           ratio={p: statistics.median(a / b for a, b in zip(v[1:], base)) for p, v in speeds.items()}))
    for model in models.values():
        model.close()
    return dict(model=model_name, precisions=list(precisions), decode_tokens=tokens, rounds=rounds, points=points)


def prefix_ttft(model_name: str, prefix_tokens: int = 1000, repeat: int = 3, turns: int = 10) -> dict:
    """Prefix reuse as a default-configured model meets it: TTFT of a chat whose ~1,000-token
    system prompt is new, then of one that shares it; and each turn's TTFT in a `turns`-turn
    chat (Model.chat re-sends the whole conversation, as apps do)."""
    import edgellm

    model = edgellm.load(model_name)  # prefix reuse is on by default
    tokenizer = model.tokenizer
    system = {"role": "system", "content": tokenizer.decode(bench_prompt(tokenizer, prefix_tokens))}
    cold, warm = [], []
    for i in range(repeat):
        model.kv.forget_prefixes()
        cold.append(model.chat([system, {"role": "user", "content": f"Question {i}: who?"}], max_tokens=1))
        warm.append(model.chat([system, {"role": "user", "content": f"Question {i}: where?"}], max_tokens=1))
    cold_s = statistics.median(d.timings.ttft_s for d in cold)
    warm_s = statistics.median(d.timings.ttft_s for d in warm)
    chat = _chat_turns(model, system, turns)
    model.close()
    return dict(model=model_name, prefix_tokens=prefix_tokens, cold_ttft_s=cold_s, warm_ttft_s=warm_s,
                speedup=cold_s / warm_s, warm_prefix_hit_tokens=warm[-1].timings.prefix_hit_tokens,
                chat_turns=chat, chat_turn_last_vs_second=chat[-1]["ttft_s"] / chat[1]["ttft_s"])


def _chat_turns(model, system: dict, turns: int) -> list[dict]:
    model.kv.forget_prefixes()
    messages, report = [system], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn + 1}: tell me one more fact about the text."})
        done = model.chat(messages, max_tokens=48, ignore_eos=True)
        messages.append({"role": "assistant", "content": done.text})
        t = done.timings
        report.append(dict(turn=turn + 1, prompt_tokens=t.prompt_tokens, prefix_hit_tokens=t.prefix_hit_tokens,
                           ttft_s=t.ttft_s))
    return report


def soak(model_name: str, tokens: int = 20_000, window: int = 512, every: int = 1000) -> dict:
    """Stream `tokens` through the sink + sliding window; RSS and KV bytes every `every` tokens."""
    import edgellm
    from edgellm.generation import TokenEvent
    from edgellm.kv import KVConfig

    model = edgellm.load(model_name, kv=KVConfig(max_tokens=window))
    samples, count, start = [], 0, time.perf_counter()
    for event in model.stream("Tell me an endless story about a lighthouse keeper.", max_tokens=tokens,
                              ignore_eos=True, temperature=0.8, top_p=0.95, seed=1, repetition_penalty=1.1):
        if isinstance(event, TokenEvent):
            count += 1
            if count % every == 0:
                samples.append(dict(tokens=count, rss_bytes=rss_bytes(), kv_bytes=model.kv.pool.used_bytes))
    elapsed = time.perf_counter() - start
    rss = [s["rss_bytes"] for s in samples]
    return dict(model=model_name, tokens=count, window=window, seconds=elapsed, samples=samples,
                rss_spread_bytes=max(rss) - min(rss) if rss else 0)
