"""Mechanism: run one step the scheduler chose — prompt chunks, then one batched decode step —
and hand back each request's new events. Knows nothing of queues, deadlines or fallbacks."""
from __future__ import annotations

from collections import defaultdict
from typing import Hashable


from edgellm.extras import inference

from edgellm.generation.generator import decode_with_prompt_chunks
from edgellm.generation.passes import decode_step
from edgellm.kernels.limits import MAX_SEQS
from edgellm.serving.scheduler import RequestState, RunningRequest, Step, joins


class Engine:
    max_rows = MAX_SEQS  # the rows one native call takes (the scheduler's StepBudget.step_rows)

    @staticmethod
    def batch_key(generation) -> Hashable | None:
        """What a request runs on, as a value the scheduler compares: requests of one key can
        share a native call (one network with a native decoder, one KV precision); None where the
        model has no native decoder and each request runs alone."""
        if getattr(generation.model, "decoder", None) is None:
            return None
        return id(generation.model), generation.kv.precision

    def step(self, step: Step) -> dict[RunningRequest, list]:
        """Events per request: TokenEvents, a Completion when it ended, or the exception that
        ended it (a failure ends only the requests it touched)."""
        events: dict[RunningRequest, list] = {}
        with inference():
            if step.prefill and step.decode and self._together(step, events):
                return events
            for request, tokens in step.prefill:
                events[request] = self._prefill(request, tokens)
            for group in _by_model(step.decode):
                events.update(self._decode(group))
        return events

    @staticmethod
    def _together(step: Step, events: dict) -> bool:
        """The decode step and the newcomers' prompt chunks as one native call, where they share a
        network and KV precision; False (nothing run) otherwise."""
        if any(r.generation.scores_prompt for r, _ in step.prefill):
            return False  # a scored prompt goes in through prefill_step, every position's logits kept
        if len(step.decode) >= Engine.max_rows or not all(joins(step.decode + [r for r, _ in step.prefill[:i]], newcomer)
                                                         for i, (newcomer, _) in enumerate(step.prefill)):
            return False
        for newcomer, tokens in list(step.prefill):
            try:  # each newcomer's room first: one that has none fails alone
                newcomer.generation.seq.prepare(min(tokens, newcomer.generation.prompt_left))
            except Exception as error:
                events[newcomer] = [error]
                step.prefill.remove((newcomer, tokens))
        if not step.prefill:
            return False
        joined = [r for r, _ in step.prefill]
        try:
            done = decode_with_prompt_chunks(joined[0].generation.model, [r.generation for r in step.decode],
                                             [(r.generation, tokens) for r, tokens in step.prefill])
        except Exception as error:  # the call itself failed: everyone in it
            events.update({r: [error] for r in step.decode + joined})
            return True
        if done is None:
            return False
        logits, firsts = done
        events.update({r: _accept(r, logits[i]) for i, r in enumerate(step.decode)})
        for newcomer, first in zip(joined, firsts):
            events[newcomer] = []
            if first is not None:
                newcomer.state = RequestState.DECODING
                events[newcomer] = _accept(newcomer, first)
        return True

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
        if len(group) == 1 and group[0].generation.speculator is not None:
            try:  # alone on its network: its drafter's guesses fill the step instead of other streams
                return {group[0]: group[0].generation.decode()}
            except Exception as error:
                return {group[0]: [error]}
        try:
            logits = decode_step(group[0].generation.model, [r.generation for r in group])
        except Exception as error:
            return {r: [error] for r in group}
        return {r: _accept(r, row) for r, row in zip(group, logits)}


def _accept(request: RunningRequest, logits) -> list:
    """The request's events from its logits; its sampling failing ends only that request."""
    try:
        return request.generation.accept(logits)
    except Exception as error:
        return [error]


def _by_model(requests: list[RunningRequest]) -> list[list[RunningRequest]]:
    """Requests on the same network and KV precision decode as one batch (a fallback model or
    a fallback precision runs its own), whatever LoRA adapter each runs under: the layers add
    each row's own."""
    groups: dict[tuple[int, str], list[RunningRequest]] = defaultdict(list)
    for r in requests:
        groups[id(r.generation.model), r.generation.kv.precision].append(r)
    return list(groups.values())
