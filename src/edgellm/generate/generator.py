"""The generation loop for one sequence: prefill the prompt, then sample, decode and stream
until EOS, a stop string, max_tokens or the end of the context."""
from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import torch

from edgellm.errors import ContextOverflow, InvalidRequest
from edgellm.generate.events import Completion, GenerationEvent, Timings, TokenEvent
from edgellm.generate.sampling import Sampler, SamplingParams
from edgellm.generate.text import IncrementalDetokenizer, StopMatcher
from edgellm.kv import make_caches
from edgellm.memory import peak_rss_bytes


class CausalLM(Protocol):
    config: object  # has n_layers, context_length

    def __call__(self, tokens: torch.Tensor, caches: list, last_only: bool = False) -> torch.Tensor: ...


def stream_generate(model: CausalLM, prompt_ids: list[int], params: SamplingParams, *,
                    token_bytes: Callable[[int], bytes], eos_ids: frozenset[int],
                    context_length: int | None = None) -> Iterator[GenerationEvent]:
    """Yields a TokenEvent per generated token, then one Completion."""
    context = context_length or model.config.context_length
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if len(prompt_ids) >= context:
        raise ContextOverflow(len(prompt_ids), context)
    budget = min(params.max_tokens, context - len(prompt_ids))
    sampler, detok, stops = Sampler(params), IncrementalDetokenizer(token_bytes), StopMatcher(params.stop)
    caches = make_caches(model.config.n_layers)
    history, generated, pieces = list(prompt_ids), [], []
    finish, stop = "length", None

    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids]), caches, last_only=True)[0, -1]
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
                logits = model(torch.tensor([[token]]), caches, last_only=True)[0, -1]
    end = time.perf_counter()

    tail = "" if stops.matched is not None else _tail(detok, stops)
    if stops.matched is not None and stop is None:
        finish, stop = "stop", stops.matched
    timings = Timings(
        prompt_tokens=len(prompt_ids), completion_tokens=len(generated),
        ttft_s=first_token_at - start, prefill_s=prefill_done - start,
        decode_s=end - first_token_at, peak_rss_bytes=peak_rss_bytes())
    yield Completion(finish, "".join(pieces) + tail, tuple(generated), tail, timings, stop)


def _tail(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what was held back: a stop string may still complete in the flushed bytes."""
    text = stops.push(detok.flush())
    return text if stops.matched is not None else text + stops.flush()
