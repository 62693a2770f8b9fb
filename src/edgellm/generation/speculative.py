"""Speculative decoding: a drafter guesses k tokens, the target checks them in one pass.

Decode reads every weight once per token; the target's pass over [next token, k guesses] reads
them once for up to k + 1 tokens (models/native/decoder.py runs those rows as one native call). Each
guess is judged as plain decoding would have chosen, so the text is the target's own:

* greedy: the target's token at each position (its sampler: repetition penalty included) is
  taken; guesses stay accepted while they equal it; the first difference is the correction.
* sampling (Leviathan et al., 2023): guess d drawn with probability q(d) is kept with
  probability min(1, p(d)/q(d)); on rejection the token is drawn from normalize(max(0, p - q)).
  The output distribution is exactly the target's p. A deterministic guess has q one-hot.

The KV of rejected guesses is trimmed (rings give back what the guesses overwrote). The draft
length maximizes the measured tokens per second (AdaptiveSpeculation), and speculation pauses
while no length beats plain decoding. docs/speculative.md has the measurements."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgellm.generation.drafters import Drafter
from edgellm.generation.events import GenerationEvent
from edgellm.generation.passes import decode_step, verify
from edgellm.kernels.limits import MAX_SEQS

MAX_DRAFT = MAX_SEQS - 1  # + the token before them: the rows of one native call
JUDGE_AFTER = 3  # checked passes before speculation may be paused


@dataclass
class SpeculationCosts:
    """What generations measured with one drafter on one model, handed from each to the next
    (a model keeps one per drafter kind): seconds of a plain step and extra seconds per guess,
    and the verdict the last one ended with (None: none judged yet)."""
    plain_s: float | None = None
    guess_s: float | None = None
    pays: bool | None = None  # some draft length beat plain decoding at the acceptance measured

    @property
    def never_pays(self) -> bool:
        """A guess costs a whole step: no acceptance rate can make checking guesses pay."""
        return self.plain_s is not None and self.guess_s is not None and self.guess_s >= self.plain_s


@dataclass
class SpeculationStats:
    drafted: int = 0  # guesses checked
    accepted: int = 0  # guesses the target kept
    passes: int = 0  # target passes (verifications and plain steps)


class AdaptiveSpeculation:
    """How many guesses to check now, from what was measured so far in this generation: the
    seconds of a plain step, the extra seconds each guess adds to a checked pass (drafting it
    and one more row), and the chance a guess is kept. With k guesses kept each with chance a
    in a row, a pass yields 1 + a + ... + a^k tokens; k maximizes tokens per second, and while
    no k beats plain decoding, decoding stays plain for `retry_every` steps, then speculation
    is measured afresh with one guess a pass (acceptance changes with the text); each failed
    retry doubles the wait (a draft model's catching up is not free), up to `max_wait`, which a
    guess costing a whole step gets at once. A draft model's verdict that no length pays holds
    for later generations (they start plain for `max_wait` steps: its first check would cost a
    catch-up over the whole prompt, ~150 ms for a 40-token chat here); verdicts on guesses that
    are free to make (prompt lookup) later generations check again."""

    def __init__(self, max_draft: int = MAX_DRAFT, start: int = 4, retry_every: int = 32, max_wait: int = 512,
                 known: SpeculationCosts | None = None, free_guesses: bool = False):
        self.max_draft, self.k, self.retry_every, self.max_wait = max_draft, min(start, max_draft), retry_every, max_wait
        self.wait = retry_every
        known = known or SpeculationCosts()
        self.plain_s = known.plain_s  # seconds per plain step
        self.guess_s = known.guess_s  # extra seconds per guess in a checked pass
        self.kept = self.tried = 0.0  # guesses kept / guesses the target looked at (decayed)
        self.plain_left = 0 if known.plain_s is not None else 1  # a plain step first: the yardstick
        if known.never_pays and free_guesses:
            # earlier generations judged that no guess pays, though guesses cost only their rows:
            # plain for a while, then one guess a pass with its cost measured afresh. A judgement
            # made in one unlucky moment (the host stalling in a checked pass) must not keep a process
            # plain for good.
            self.plain_left, self.k, self.guess_s = retry_every, 1, None
        elif known.never_pays or (known.pays is False and not free_guesses):  # retried only after the longest wait
            self.plain_left, self.wait = max_wait, max_wait
        self.pays = known.pays  # what the last plan found
        self.fresh = True  # the next checked pass starts a streak (a draft model catches up then)
        self.checks = 0  # checked passes in this streak: a pause needs a few (one unlucky check is noise)

    def draft_length(self) -> int:
        """Guesses to make now; 0: take a plain step."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        return self.k

    def record_plain(self, seconds: float) -> None:
        self.plain_s = _mean(self.plain_s, seconds)

    def record_check(self, seconds: float, drafted: int, kept: int) -> None:
        # a guess after a rejected one was never looked at: the chance is kept / looked at
        self.kept, self.tried = 0.9 * self.kept + kept, 0.9 * self.tried + kept + (kept < drafted)
        if not self.fresh and self.plain_s is not None:
            self.guess_s = _mean(self.guess_s, max(seconds - self.plain_s, 0.0) / drafted)
        self.fresh, self.checks = False, self.checks + 1
        self._plan()

    def expected_tokens(self, k: int) -> float:
        a = min(self.kept / self.tried, 0.99) if self.tried else 0.5
        return (1 - a ** (k + 1)) / (1 - a)

    def _plan(self) -> None:
        if self.plain_s is None or self.guess_s is None:
            return
        rate, k = max((self.expected_tokens(k) / (self.plain_s + self.guess_s * k), k)
                      for k in range(1, self.max_draft + 1))
        if rate * self.plain_s > 1.0:
            self.k, self.wait, self.pays = k, self.retry_every, True
        elif self.checks >= JUDGE_AFTER:  # no draft length beats a plain step now
            self.pays = False
            if self.guess_s >= self.plain_s:  # nor can any acceptance: a guess costs a whole step
                self.wait = self.max_wait
            self.plain_left, self.fresh, self.kept, self.tried, self.checks = self.wait, True, 0.0, 0.0, 0
            self.wait, self.k = min(2 * self.wait, self.max_wait), 1  # the retry: one guess a pass


def _mean(old: float | None, new: float) -> float:
    """A running mean that follows drift (thermal throttling, other load)."""
    return new if old is None else 0.8 * old + 0.2 * new


def choose(generation, logits, guess: int, q: np.ndarray | None) -> int:
    """The token plain decoding stands in for at this position, given the guess."""
    sampler = generation.sampler
    logits = generation.masked(logits)
    p = sampler.probs(logits, generation.history)
    if p is None:  # greedy
        return sampler(logits, generation.history)
    q_guess = 1.0 if q is None else float(q[guess])
    if q_guess > 0 and sampler.uniform() * q_guess < float(p[guess]):
        return guess
    if q is None:
        residual = p.copy()
        residual[guess] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    if float(residual.sum()) <= 0:  # p == q: nothing left to correct towards
        return sampler.draw(p)
    return sampler.draw(residual)  # draw() normalizes


class Speculator:
    """One generation's speculation: its drafter, the adaptive policy and the counts."""

    def __init__(self, drafter: Drafter, costs: SpeculationCosts | None = None):
        self.drafter, self.stats, self.costs = drafter, SpeculationStats(), costs
        self.policy = AdaptiveSpeculation(known=costs, free_guesses=getattr(drafter, "free_guesses", False))

    def step(self, model, generation) -> list[GenerationEvent]:
        """A plain decode step or a verified draft; the events it releases."""
        started = time.perf_counter()
        k = min(self.policy.draft_length(), generation.budget - len(generation.generated) - 1)
        guesses, q = self.drafter.propose(generation.history, k) if k > 0 else ([], None)
        if guesses and generation.grammar is not None:  # a guess the grammar forbids cannot be kept
            guesses = guesses[:generation.grammar.valid_prefix(guesses)]
            q = None if q is None else q[:len(guesses)]
        if not guesses:
            events = generation.accept(decode_step(model, [generation])[0])
            self._count(time.perf_counter() - started, "plain", 0, 0)
            return events
        logits = verify(model, generation.seq, [generation.next_token] + guesses)
        events, kept = [], 0
        for i, guess in enumerate(guesses):
            token = choose(generation, logits[i], guess, None if q is None else q[i])
            events += generation.emit(token)
            if generation.done or token != guess:
                break
            kept += 1
        else:
            events += generation.accept(logits[len(guesses)])  # all kept: the target's next one is free
        if not generation.done:
            generation.seq.trim(len(guesses) - kept)
        self._count(time.perf_counter() - started, "spec", len(guesses), kept)
        return events

    def _count(self, seconds: float, mode: str, drafted: int, kept: int) -> None:
        s = self.stats
        s.drafted, s.accepted, s.passes = s.drafted + drafted, s.accepted + kept, s.passes + 1
        if mode == "plain":
            self.policy.record_plain(seconds)
        else:
            self.policy.record_check(seconds, drafted, kept)

    def close(self) -> None:
        """Release the drafter; hand what was measured on to the next generation."""
        self.drafter.close()
        if self.costs is not None and self.policy.plain_s is not None:
            self.costs.plain_s, self.costs.guess_s = self.policy.plain_s, self.policy.guess_s
            self.costs.pays = self.policy.pays
