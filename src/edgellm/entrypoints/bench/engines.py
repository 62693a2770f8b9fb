"""The engines a benchmark compares, behind one tiny interface: load, then timed runs.

Each engine runs in its own worker process (see worker.py), so its peak RSS and cold start
are its own."""
from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources


def bench_text() -> str:
    return resources.files("edgellm").joinpath("data/heldout.txt").read_text()


def prompt_of(tokens: list[int], n: int) -> list[int]:
    """n prompt tokens: the held-out text's tokens, repeated as needed."""
    if not tokens:
        raise ValueError("empty token list")
    return (tokens * (n // len(tokens) + 1))[:n]


def bench_prompt(tokenizer, n: int) -> list[int]:
    """n tokens of the held-out text, as edgellm's tokenizer reads it."""
    return prompt_of(tokenizer.encode(bench_text(), add_special_tokens=False), n)


@dataclass(frozen=True)
class RunTiming:
    ttft_s: float  # prompt in -> first generated token out (prefill + first sample)
    decode_s: float  # first token -> last token
    generated: int


class EdgeEngine:
    name = "edgellm"

    def __init__(self, path: str, threads: int, mode: str = "fast", kv: str | None = None):
        import edgellm
        from edgellm.kv import KVConfig

        # Repeats send the same prompt: a prefix cache would turn prefill into a lookup (llama.cpp
        # is reset before each run too).
        precision = {} if kv is None else dict(k_precision=kv, v_precision=kv)
        self.model = edgellm.load(path, threads=threads, mode=mode, kv=KVConfig(prefix_cache_bytes=0, **precision))

    def tokens(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text, add_special_tokens=False)

    def run(self, ids: list[int], gen: int) -> RunTiming:
        done = self.model.generate(ids, max_tokens=gen, ignore_eos=True)
        t = done.timings
        return RunTiming(t.ttft_s, t.decode_s, t.completion_tokens)


LLAMA_KV_TYPES = {"f16": 1, "int8": 8}


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python (the `bench` extra), greedy, same token ids."""

    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int, kv: str | None = None):
        from llama_cpp import Llama

        # edgellm's KV precisions as llama.cpp's cache types (ggml's F16, Q8_0); a quantized V cache
        # needs flash attention there
        cache = {} if kv is None else dict(type_k=LLAMA_KV_TYPES[kv], type_v=LLAMA_KV_TYPES[kv], flash_attn=True)
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, **cache)

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def run(self, ids: list[int], gen: int) -> RunTiming:
        self.llm.reset()
        start = time.perf_counter()
        first = last = start
        count = 0
        for count, _ in enumerate(self.llm.generate(ids, top_k=1, temp=0.0, reset=True), start=1):
            last = time.perf_counter()
            if count == 1:
                first = last
            if count == gen:
                break
        return RunTiming(first - start, last - first, count)
