"""Drafters for speculative decoding: cheap guesses of the next k tokens, which the target model
then checks in one pass (generation/speculative.py).

* PromptLookup — no model: continue the longest recent n-gram of the context that occurred
  before (summaries, rewrites, RAG answers and code edits copy spans of their prompt).
* GrammarForced — under a constraint, the tokens the grammar forces next.
* DraftModel — a smaller model with the same vocabulary (or the target's first layers: the
  self-speculative draft), decoding greedily or by sampling on its own KV cache, rolled back
  when the target rejects its guesses.

A drafter sees the whole context (prompt + accepted tokens) at every call and keeps nothing the
target has not accepted."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from edgellm.errors import InvalidRequest
from edgellm.extras import inference, torch

from edgellm.generation.passes import prefill, run_rows
from edgellm.generation.sampling import Sampler, greedy
from edgellm.kernels.limits import MAX_SEQS
from edgellm.kv import KVManager, SequenceKV


class Drafter(Protocol):
    name: str
    # guesses cost nothing to make (no model runs for them): a check costs only its rows, so a
    # verdict that guesses do not pay is worth checking again (AdaptiveSpeculation)
    free_guesses: bool

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        """Up to k guessed next tokens after `context`, and the probabilities they were drawn
        with ((len, V); None: chosen deterministically, i.e. q is one-hot)."""
        ...

    def close(self) -> None: ...


class PromptLookup:
    """Find the most recent earlier occurrence of the context's last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose what followed it.

    The latest start of every n-gram is indexed once, as the context grows (a step costs its new
    tokens, not a scan of the context): the context must be one growing list, a generation's
    history; another list starts the index afresh."""

    name = "lookup"
    free_guesses = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._context: Sequence[int] | None = None
        self._indexed = 0  # n-grams ending before this position are in _latest
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        self._index(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(context[-n:]))
            if start is not None:
                return list(context[start + n:start + n + k]), None
        return [], None

    def _index(self, context: Sequence[int]) -> None:
        """Index the n-grams that end before the context's last token (the last n-gram itself
        must match an earlier occurrence)."""
        if context is not self._context or len(context) < self._indexed:
            self._context, self._indexed, self._latest = context, 0, {}
        end = len(context) - 1
        for stop in range(self._indexed + 1, end + 1):
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                self._latest[tuple(context[stop - n:stop])] = stop - n
        self._indexed = max(self._indexed, end)

    def close(self) -> None:
        pass


class DraftModel:
    """A model drafting for a target with the same vocabulary. Its KV cache follows the accepted
    context: each call first feeds what the draft has not seen, then decodes k tokens, then
    forgets them again (the target decides which stay)."""

    name = "draft"
    free_guesses = False  # each guess is a step of the draft, and a streak starts with its catching up

    def __init__(self, net, kv: KVManager, sampler: Sampler | None = None, name: str = "draft"):
        self.net, self.kv, self.sampler, self.name = net, kv, sampler, name
        self.seq: SequenceKV | None = None

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        if self.seq is None:
            self.seq, _ = self.kv.new_sequence([])
        seen = self._common_prefix(context)
        self.seq.trim(self.seq.offset - seen)
        logits = self._feed(list(context[seen:]))
        drafted, probs, history = [], [], list(context)
        for i in range(k):
            token, p = self._pick(logits, history)
            drafted.append(token)
            history.append(token)
            if p is not None:
                probs.append(p)
            if i + 1 < k:
                logits = self._feed([token])
        return drafted, (np.stack(probs) if probs else None)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Tokens into the draft's KV; the last one's logits. A short catch-up goes as rows of
        native calls (a prompt pass of an unseen length would first build PyTorch kernels)."""
        if len(tokens) > 4 * MAX_SEQS:
            return prefill(self.net, self.seq, tokens)
        for start in range(0, len(tokens), MAX_SEQS):
            logits = run_rows(self.net, self.seq, tokens[start:start + MAX_SEQS])
        return logits.reshape(-1)

    def _common_prefix(self, context: Sequence[int]) -> int:
        held = self.seq.token_ids
        n = min(len(held), len(context) - 1)  # the last context token must be fed for its logits
        same = 0
        while same < n and held[same] == context[same]:
            same += 1
        return same

    def _pick(self, logits: torch.Tensor, history: list[int]) -> tuple[int, np.ndarray | None]:
        probs = None if self.sampler is None else self.sampler.probs(logits, history)
        if probs is None:  # greedy
            return greedy(logits), None
        return self.sampler.draw(probs), probs

    def close(self) -> None:
        if self.seq is not None:
            self.seq.release()
            self.seq = None


class GrammarForced:
    """Under a constraint, the tokens its grammar forces next (a JSON key and its quotes after
    a value) are sure guesses; elsewhere `then`'s guesses, if there is a drafter. The model
    still checks them, so the tokens are plain constrained decoding's own."""

    def __init__(self, grammar, then: Drafter | None = None):
        self.grammar, self.then = grammar, then
        self.name = "grammar" if then is None else f"grammar+{then.name}"
        self.free_guesses = then is None or then.free_guesses

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        forced = self.grammar.forced()[:k]
        if forced or self.then is None:
            return forced, None
        return self.then.propose(context, k)

    def close(self) -> None:
        if self.then is not None:
            self.then.close()


class NoDraft:
    """A drafter that never guesses: decoding stays plain (a self-speculative draft that
    measured it would not pay)."""

    def __init__(self, name: str):
        self.name, self.free_guesses = name, True

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        return [], None

    def close(self) -> None:
        pass


# What one more row of a checked pass costs, relative to a plain decode step (SmolLM2 on Zen 3:
# 12 ms for one row, +4.3 ms per row; docs/speculative.md). A planning prior only: at run time
# AdaptiveSpeculation measures the real costs.
ROW_COST = 0.35


def best_self_draft(agreement: dict[int, float], n_layers: int, max_draft: int = 7) -> tuple[int | None, float]:
    """The first-layers count whose draft pays most, by the agreement measured for it (a guess
    costs n / n_layers of a step plus a row of the check), and its predicted speedup; None when
    none beats plain decoding."""
    best, speedup = None, 1.0
    for n, a in agreement.items():
        a = min(a, 0.99)
        for k in range(1, max_draft + 1):
            predicted = (1 - a ** (k + 1)) / (1 - a) / (1 + k * (n / n_layers + ROW_COST))
            if predicted > speedup:
                best, speedup = n, predicted
    return best, speedup


def early_exit_agreement(net, kv: KVManager, tokens: Sequence[int], candidates: Sequence[int]) -> dict[int, float]:
    """For each n in `candidates`: how often the model's head on the hidden state after its
    first n blocks picks the same next token as the whole model, teacher-forced over `tokens`
    (what a self-speculative draft of n layers would get accepted, greedily)."""
    if getattr(net, "decoder", None) is not None:
        return _early_exit_agreement_natively(net, kv, tokens, candidates)
    captured: dict[int, torch.Tensor] = {}
    hooks = [net.blocks[n - 1].register_forward_hook(lambda _m, _i, out, n=n: captured.__setitem__(n, out))
             for n in candidates]
    seq, _ = kv.new_sequence([])
    try:
        seq.prepare(len(tokens))
        with inference():
            final = net(np.array([list(tokens)], dtype=np.int64), seq)[0].argmax(-1)
            return {n: float((net.head(captured[n])[0].argmax(-1) == final).float().mean()) for n in candidates}
    finally:
        for hook in hooks:
            hook.remove()
        seq.release()


def _early_exit_agreement_natively(net, kv: KVManager, tokens: Sequence[int],
                                   candidates: Sequence[int]) -> dict[int, float]:
    """early_exit_agreement on the native decoder, which keeps no hidden state between layers: the
    model and each first-n-layers draft (models.first_layers) run over `tokens` on KV of their own,
    every row's logits read. The same tokens as the PyTorch layers' hooks pick, up to near-ties."""
    from edgellm.models import first_layers

    final = _greedy_rows(net, kv, tokens)
    return {n: float(np.mean(_greedy_rows(first_layers(net, n), kv, tokens) == final)) for n in candidates}


def _greedy_rows(net, kv: KVManager, tokens: Sequence[int]) -> np.ndarray:
    """Each position's greedy next token under `net` (its decoder), teacher-forced over `tokens`, on
    a KV manager of its own without prefix reuse (nothing it computes is offered to others)."""
    from dataclasses import replace


    own = KVManager(net.cache_specs(), replace(kv.config, prefix_cache_bytes=0), len(tokens) + MAX_SEQS)
    seq, _ = own.new_sequence([])
    picks = []
    try:
        for start in range(0, len(tokens), MAX_SEQS):
            piece = [int(t) for t in tokens[start:start + MAX_SEQS]]
            seq.prepare(len(piece))
            logits = net.decoder.step_rows([(seq.layers, piece)], every_row=True)
            if logits is None:
                raise InvalidRequest("the native decoder cannot measure the self-draft here")
            picks.append(logits.argmax(-1))
            seq.advance(piece)
    finally:
        seq.release()
    return np.concatenate(picks)
