"""The generation loop for one sequence: prefill the prompt (after any cached prefix), then
sample, decode and stream until EOS, a stop string, max_tokens or the end of the context."""
from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np

from edgellm.extras import inference

from edgellm.errors import ContextOverflow, InvalidRequest
from edgellm.generation.events import Completion, GenerationEvent, Timings, TokenEvent
from edgellm.generation.drafters import Drafter
from edgellm.generation.constrain.closing import CannotClose, closer_for
from edgellm.generation.logprobs import TokenLogprob, token_logprob
from edgellm.generation.passes import CausalLM, decode_step, prefill, prefill_chunk, prefill_scored
from edgellm.generation.sampling import Sampler, SamplingParams, as_logits
from edgellm.generation.speculative import SpeculationCosts, Speculator
from edgellm.generation.text import IncrementalDetokenizer, StopMatcher
from edgellm.kv import KVManager
from edgellm.memory import peak_rss_bytes, return_freed_heap

CLOSE_WINDOW = 96  # tokens before the budget's end from which a JSON output's closing is worked out
CLOSE_MARGIN = 6  # a token may open a structure whose closing is this much longer


class Generation:
    """One sequence's generation as explicit steps (prefill, then accept one logits row at a
    time), so an engine can run the decode steps of several sequences as one batch."""

    def __init__(self, model: CausalLM, prompt_ids: list[int], params: SamplingParams, *,
                 token_bytes: Callable[[int], bytes], eos_ids: frozenset[int], kv: KVManager,
                 context_length: int | None = None, grammar=None):
        context = context_length or model.config.context_length
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= context:
            raise ContextOverflow(len(prompt_ids), context)
        sliding = kv.config.max_tokens is not None
        self.budget = params.max_tokens if sliding else min(params.max_tokens, context - len(prompt_ids))
        kv.admit(len(prompt_ids) + self.budget)
        self.model, self.kv, self.params, self.eos_ids = model, kv, params, eos_ids
        self.prompt_ids = list(prompt_ids)
        self.sampler = Sampler(params, prompt_tokens=len(prompt_ids))
        self.detok, self.stops = IncrementalDetokenizer(token_bytes), StopMatcher(params.stop)
        self.history, self.generated, self.pieces = list(prompt_ids), [], []
        self.token_logprobs: list[TokenLogprob] = []
        # scoring the prompt needs every position's logits: no cached prefix stands in for them
        self.prompt_scores: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else [None]
        self._last_row: np.ndarray | None = None  # the scored prefill's last logits so far
        self.start = time.perf_counter()
        self.seq, self.reused = kv.new_sequence(prompt_ids if self.prompt_scores is None else [])
        self.prefilled = self.reused  # prompt tokens in the KV so far
        self.prefill_done = self.first_token_at = self.start
        self.next_token: int | None = None  # to feed the next decode step
        self.completion: Completion | None = None
        self.speculator: Speculator | None = None  # decode steps check a drafter's guesses (speculate())
        self.grammar = grammar  # a constrain.GrammarState: only tokens that keep the output valid
        self.closer = None if grammar is None else closer_for(grammar.constraint)  # JSON: closes before the budget cuts
        self.closed_early = False
        self.token_bytes = token_bytes

    @property
    def done(self) -> bool:
        return self.completion is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) - self.prefilled

    def prefill(self) -> np.ndarray:
        """The whole (rest of the) prompt; returns its last position's logits."""
        logits = None
        while logits is None:
            logits = self.prefill_step(self.prompt_left)
        return logits

    def prefill_step(self, max_tokens: int) -> np.ndarray | None:
        """Prefill up to max_tokens more prompt tokens (an engine interleaves these chunks with
        other sequences' decode steps); returns the last position's logits once the prompt is in."""
        piece = self.next_prompt_piece(max_tokens)
        if self.prompt_scores is None:
            logits = prefill(self.model, self.seq, piece, prefill_chunk(self.kv))
        else:
            logits, scored = prefill_scored(self.model, self.seq, piece, self.params.prompt_logprobs, self._last_row)
            self.prompt_scores += scored
            self._last_row = logits
        return self.prompt_advanced(len(piece), logits)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt goes in scored, position by position (prefill_step only)."""
        return self.prompt_scores is not None

    def next_prompt_piece(self, max_tokens: int) -> list[int]:
        return self.prompt_ids[self.prefilled:self.prefilled + min(max_tokens, self.prompt_left)]

    def prompt_advanced(self, n: int, logits: np.ndarray | None) -> np.ndarray | None:
        """n more prompt tokens are in the KV (`logits` of the last); the logits once all are."""
        self.prefilled += n
        if self.prompt_left:
            return None
        self.prefill_done = self.first_token_at = time.perf_counter()
        return logits

    def accept(self, logits: np.ndarray) -> list[GenerationEvent]:
        """Sample from one position's logits; returns the events this step releases."""
        if len(self.generated) >= self.budget:
            return [self.finish("length", None)]
        token = self.sampler(self.masked(logits), self.history)
        top = self.params.logprobs
        return self.emit(token, None if top is None else token_logprob(as_logits(logits), token, top))

    def _closing(self) -> list[int] | None:
        """The tokens that end a JSON output validly, when the budget left is about what they
        need (CLOSE_MARGIN more); None while there is room, or when no closing can be made."""
        left = self.budget - len(self.generated)
        if self.closer is None or left > CLOSE_WINDOW:
            return None
        try:
            text = b"".join(self.token_bytes(t) for t in self.generated).decode("utf-8")
            tokens = self.grammar.closing_tokens(self.closer.closing(text))
        except (CannotClose, UnicodeDecodeError):
            return None
        return tokens if tokens is not None and left - CLOSE_MARGIN <= len(tokens) <= left else None

    def _close(self, tokens: list[int]) -> list[GenerationEvent]:
        """Take the closing tokens (the grammar checked them; the model need not compute them) and end."""
        events: list[GenerationEvent] = []
        for token in tokens:
            self.grammar.consume(token)
            self.history.append(token)
            self.generated.append(token)
            text = self.stops.push(self.detok.push(token))
            self.pieces.append(text)
            events.append(TokenEvent(token, text))
        self.closed_early = True
        return events + [self.finish("stop", None)]

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A position's logits with what the grammar forbids next at -inf (unconstrained: as is)."""
        return logits if self.grammar is None else self.grammar.mask(logits)

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> list[GenerationEvent]:
        """Take `token` as the next one (sampled, or a verified speculative guess)."""
        if not self.generated:
            self.first_token_at = time.perf_counter()
        if token in self.eos_ids and not self.params.ignore_eos:
            return [self.finish("stop", token)]
        if self.grammar is not None:
            self.grammar.consume(token)
        self.history.append(token)
        self.generated.append(token)
        text = self.stops.push(self.detok.push(token))
        self.pieces.append(text)
        if logprob is not None:
            self.token_logprobs.append(logprob)
        events: list[GenerationEvent] = [TokenEvent(token, text, logprob)]
        if self.stops.matched is not None:
            events.append(self.finish("stop", self.stops.matched))
        elif text and self.grammar is not None and (keep := self.grammar.end_at(self.pieces)) is not None:
            events.append(self.finish("stop", token, keep))
        elif len(self.generated) >= self.budget:
            events.append(self.finish("length", None))
        elif (closing := self._closing()) is not None:
            events += self._close(closing)
        else:
            self.next_token = token
        return events

    def finish(self, reason: str, stop=None, keep: int | None = None) -> Completion:
        """End now (also early: "timeout", "cancelled") and release the KV. `keep`: the text
        ends there, a whole output by the grammar (what follows is a loop it cut)."""
        end = time.perf_counter()
        tail = "" if self.stops.matched is not None else _tail(self.detok, self.stops)
        if self.stops.matched is not None:
            reason, stop = "stop", self.stops.matched
        timings = Timings(
            prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.generated),
            ttft_s=self.first_token_at - self.start, prefill_s=self.prefill_done - self.start,
            decode_s=end - self.first_token_at, peak_rss_bytes=peak_rss_bytes(), kv_bytes=self.seq.nbytes,
            prefix_hit_tokens=self.reused, mask_s=self.grammar.mask_s if self.grammar is not None else 0.0,
            **self._speculation_timings())
        # Valid only when it ended on a token where the grammar may end (EOS, or the grammar's own
        # early end): a cut (max_tokens, a timeout, a stop string) can leave an accepting prefix
        # ("12" of "128") that is not the answer.
        met = None if self.grammar is None else (keep is not None or self.grammar.satisfied and reason == "stop"
                                                  and (isinstance(stop, int) or self.closed_early))
        text = ("".join(self.pieces) + tail)[:keep]
        self.completion = Completion(
            reason, text, tuple(self.generated), tail, timings, stop, constraint_met=met,
            parsed=self._parsed(text) if met else None, closed_early=self.closed_early,
            logprobs=None if self.params.logprobs is None else tuple(self.token_logprobs),
            prompt_logprobs=None if self.prompt_scores is None else tuple(self.prompt_scores))
        self.close()
        return self.completion

    def _parsed(self, text: str):
        try:
            return self.grammar.constraint.parse(text)
        except ValueError:  # a pydantic validator beyond what the schema says
            return None

    def speculate(self, drafter: Drafter, costs: SpeculationCosts | None = None) -> None:
        """Check `drafter`'s guesses at decode steps (generation/speculative.py): the same text in
        fewer passes. Not under a window sliding over the whole sequence (it cannot take back
        rejected guesses): there decoding stays plain. `costs`: what earlier generations measured
        with this kind of drafter on this model, and where this one leaves its measurements."""
        if self.kv.config.max_tokens is None:
            self.speculator = Speculator(drafter, costs)
        else:
            drafter.close()

    def decode(self) -> list[GenerationEvent]:
        """One decode step of this sequence alone (speculative where it speculates)."""
        if self.speculator is not None:
            return self.speculator.step(self.model, self)
        return self.accept(decode_step(self.model, [self])[0])

    def _speculation_timings(self) -> dict:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return dict(speculative=self.speculator.drafter.name, drafted_tokens=stats.drafted,
                    accepted_tokens=stats.accepted, target_passes=stats.passes)

    def close(self) -> None:
        """Return the sequence's KV (idempotent), and the heap pages its prefill freed
        (~50 MB for a long Gemma prompt; glibc keeps them otherwise; ~0.1 ms)."""
        if self.speculator is not None:
            self.speculator.close()
        if self.seq.layers:
            self.seq.release()
            return_freed_heap()


def decode_with_prompt_chunks(model: CausalLM, generations: list[Generation],
                              newcomers: list[tuple[Generation, int]]) -> tuple[np.ndarray, list] | None:
    """The decode step of `generations` and the next n prompt tokens of each (newcomer, n) in one
    native call per layer (the model's decoder; at most MAX_SEQS rows in all): prompts advance
    while running streams lose only a slightly wider step. Returns their logits
    (len(generations), V) and per newcomer its last position's logits once its prompt is in
    (else None); None when the native decoder cannot take these caches."""
    decoder = getattr(model, "decoder", None)
    pieces = [new.next_prompt_piece(n) for new, n in newcomers]
    if decoder is None or not all(pieces):
        return None
    for g in generations:
        g.seq.prepare(1)
    for (new, _), piece in zip(newcomers, pieces):
        new.seq.prepare(len(piece))
    everyone = [*generations, *(new for new, _ in newcomers)]
    ending = [len(piece) == new.prompt_left for (new, _), piece in zip(newcomers, pieces)]  # their logits only
    logits = decoder.step_rows([(g.seq.layers, [g.next_token]) for g in generations]
                               + [(new.seq.layers, piece) for (new, _), piece in zip(newcomers, pieces)],
                               adapters=[g.seq.adapter for g in everyone], wanted=[True] * len(generations) + ending)
    if logits is None:
        return None
    for g in generations:
        g.seq.advance([g.next_token])
    firsts, row = [], len(generations)
    for (new, _), piece, last in zip(newcomers, pieces, ending):
        new.seq.advance(piece)
        firsts.append(new.prompt_advanced(len(piece), logits[row] if last else None))
        row += last
    return logits[:len(generations)], firsts


def stream_generate(model: CausalLM, prompt_ids: list[int], params: SamplingParams, *,
                    drafter: Drafter | None = None, costs: SpeculationCosts | None = None,
                    **options) -> Iterator[GenerationEvent]:
    """Yields a TokenEvent per generated token, then one Completion. The sequence's KV is
    released when the generator finishes or is closed early. With a drafter, decode steps
    check its guesses (generation/speculative.py): the same text, fewer passes."""
    generation = Generation(model, prompt_ids, params, **options)
    if drafter is not None:
        generation.speculate(drafter, costs)
    try:
        with inference():
            events = generation.accept(generation.prefill())
            while True:
                yield from events
                if generation.done:
                    return
                events = generation.decode()
    finally:
        generation.close()


def _tail(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what was held back: a stop string may still complete in the flushed bytes."""
    text = stops.push(detok.flush())
    return text if stops.matched is not None else text + stops.flush()
