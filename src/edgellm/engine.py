"""Mechanism: run one step the scheduler chose — prompt chunks, then one batched decode step —
and hand back each request's new events. Knows nothing of queues, deadlines or fallbacks."""
from __future__ import annotations

from collections import defaultdict

import torch

from edgellm.generate.generator import decode_step
from edgellm.scheduler import RequestState, RunningRequest, Step


class Engine:
    def step(self, step: Step) -> dict[RunningRequest, list]:
        """Events per request: TokenEvents, a Completion when it ended, or the exception that
        ended it (a failure ends only the requests it touched)."""
        events: dict[RunningRequest, list] = {}
        with torch.inference_mode():
            for request, tokens in step.prefill:
                events[request] = self._prefill(request, tokens)
            for group in _by_model(step.decode):
                events.update(self._decode(group))
        return events

    @staticmethod
    def _prefill(request: RunningRequest, tokens: int) -> list:
        try:
            logits = request.generation.prefill_step(tokens)
            if logits is None:
                return []
            request.state = RequestState.DECODING
            return request.generation.accept(logits)
        except Exception as error:
            return [error]

    @staticmethod
    def _decode(group: list[RunningRequest]) -> dict[RunningRequest, list]:
        try:
            logits = decode_step(group[0].generation.model, [r.generation for r in group])
            return {r: r.generation.accept(logits[i]) for i, r in enumerate(group)}
        except Exception as error:
            return {r: [error] for r in group}


def _by_model(requests: list[RunningRequest]) -> list[list[RunningRequest]]:
    """Requests on the same network and KV precision decode as one batch (a fallback model or
    a fallback precision runs its own)."""
    groups: dict[tuple[int, int], list[RunningRequest]] = defaultdict(list)
    for r in requests:
        groups[id(r.generation.model), id(r.generation.kv)].append(r)
    return list(groups.values())
