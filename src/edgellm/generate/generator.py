"""The generation loop for one sequence: prefill the prompt (after any cached prefix), then
sample, decode and stream until EOS, a stop string, max_tokens or the end of the context."""
from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol, Sequence

import torch

from edgellm.errors import ContextOverflow, InvalidRequest
from edgellm.generate.events import Completion, GenerationEvent, Timings, TokenEvent
from edgellm.generate.sampling import Sampler, SamplingParams
from edgellm.generate.text import IncrementalDetokenizer, StopMatcher
from edgellm.kv import KVManager, SequenceKV
from edgellm.memory import peak_rss_bytes

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds attention scratch memory


class CausalLM(Protocol):
    config: object  # has n_layers, context_length

    def __call__(self, tokens: torch.Tensor, caches: Sequence, last_only: bool = False) -> torch.Tensor: ...


def prefill(model: CausalLM, seq: SequenceKV, ids: Sequence[int], chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run `ids` through the model into `seq`; returns the last position's logits."""
    logits = None
    for start in range(0, len(ids), chunk):
        piece = list(ids[start:start + chunk])
        seq.prepare(len(piece))
        logits = model(torch.tensor([piece]), seq, last_only=True)[0, -1]
        seq.advance(piece)
    return logits


def stream_generate(model: CausalLM, prompt_ids: list[int], params: SamplingParams, *,
                    token_bytes: Callable[[int], bytes], eos_ids: frozenset[int], kv: KVManager,
                    context_length: int | None = None) -> Iterator[GenerationEvent]:
    """Yields a TokenEvent per generated token, then one Completion. The sequence's KV is
    released when the generator finishes or is closed early."""
    context = context_length or model.config.context_length
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if len(prompt_ids) >= context:
        raise ContextOverflow(len(prompt_ids), context)
    sliding = kv.config.max_tokens is not None
    budget = params.max_tokens if sliding else min(params.max_tokens, context - len(prompt_ids))
    sampler, detok, stops = Sampler(params), IncrementalDetokenizer(token_bytes), StopMatcher(params.stop)
    history, generated, pieces = list(prompt_ids), [], []
    finish, stop = "length", None

    kv.admit(len(prompt_ids) + budget)
    start = time.perf_counter()
    seq, reused = kv.new_sequence(prompt_ids)
    try:
        with torch.inference_mode():
            logits = prefill(model, seq, prompt_ids[reused:], _chunk_for(kv))
            prefill_done = first_token_at = time.perf_counter()
            for step in range(budget):
                token = sampler(logits, history)
                if step == 0:
                    first_token_at = time.perf_counter()
                if token in eos_ids and not params.ignore_eos:
                    finish, stop = "stop", token
                    break
                history.append(token)
                generated.append(token)
                text = stops.push(detok.push(token))
                pieces.append(text)
                yield TokenEvent(token, text)
                if stops.matched is not None:
                    finish, stop = "stop", stops.matched
                    break
                if step + 1 < budget:
                    seq.prepare(1)
                    logits = model(torch.tensor([[token]]), seq, last_only=True)[0, -1]
                    seq.advance([token])
        end = time.perf_counter()
        kv_bytes = seq.nbytes
    finally:
        seq.release()

    tail = "" if stops.matched is not None else _tail(detok, stops)
    if stops.matched is not None and stop is None:
        finish, stop = "stop", stops.matched
    timings = Timings(
        prompt_tokens=len(prompt_ids), completion_tokens=len(generated),
        ttft_s=first_token_at - start, prefill_s=prefill_done - start,
        decode_s=end - first_token_at, peak_rss_bytes=peak_rss_bytes(), kv_bytes=kv_bytes,
        prefix_hit_tokens=reused)
    yield Completion(finish, "".join(pieces) + tail, tuple(generated), tail, timings, stop)


def _chunk_for(kv: KVManager) -> int:
    # A ring layer must still hold a finished block when it is remembered for prefix reuse.
    windows = [s.window for s in kv.specs if s.window is not None]
    chunk = min([PREFILL_CHUNK, *windows])
    return max(kv.config.block_size, chunk // kv.config.block_size * kv.config.block_size)


def _tail(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what was held back: a stop string may still complete in the flushed bytes."""
    text = stops.push(detok.flush())
    return text if stops.matched is not None else text + stops.flush()
