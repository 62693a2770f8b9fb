"""Logits -> next token. Small pure functions on numpy arrays composed into one sampler (a
tensor's logits are read in place); randomness comes only from an explicit, seeded generator
(numpy's PCG64), so the same seed gives the same text."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np

from edgellm.errors import InvalidRequest
from edgellm.generation.logprobs import MAX_TOP
from edgellm.kernels.build import library


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; applied over prompt and output, as in HF
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    # OpenAI's: minus frequency_penalty per earlier occurrence in the output and presence_penalty once
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the prompt's tokens scored too (echo), with alternatives

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.seed is None or -2**63 <= self.seed < 2**64, f"seed must fit 64 bits, got {self.seed}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (all(0 <= n <= MAX_TOP for n in (self.logprobs, self.prompt_logprobs) if n is not None),
             f"logprobs must be in [0, {MAX_TOP}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


# Below this temperature sampling is greedy: logits / T would overflow to inf (1e-300 did) long
# before the distribution stops being one-hot in float32.
GREEDY_BELOW = 1e-5
# Logits a filtered draw (top-k, top-p, min-p) looks at natively, the few first: nucleus sampling
# at top_p 0.9-0.95 keeps tens of tokens of a small model's vocabulary. At temperature 1, top_p 0.9
# one SmolLM2 step in 10 kept 280-670 (then the tries up to 1024: ~0.45 ms, where a sort and a
# softmax over the vocabulary take several ms, more than a decode step).
CANDIDATES = (256, 1024, 4096)


class NothingToDraw(RuntimeError):
    """Every token of a distribution has weight 0 (all logits -inf or NaN): nothing can come next."""


def as_logits(logits) -> np.ndarray:
    """1-D fp32 logits as numpy: an array as it is, a CPU tensor's own memory (no copy for fp32)."""
    if not isinstance(logits, np.ndarray) and hasattr(logits, "detach"):  # a torch tensor
        logits = logits.detach().float().numpy()
    return np.asarray(logits, dtype=np.float32)


def greedy(logits) -> int:
    """The first maximum of 1-D logits: the native kernel where there is one (it runs on this
    thread: kernels/pool.h), else numpy's."""
    x = as_logits(logits)
    if _native_input(x) and x.size:
        return library().edgellm_argmax(x.ctypes.data, x.size)
    return int(np.argmax(x))


def _native_input(x: np.ndarray) -> bool:
    """Whether kernels/sample.c can read these logits: fp32, 1-D, contiguous, and a library built."""
    return x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous and library() is not None


def softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    if top == -np.inf:  # every token masked: no distribution (draw() says so)
        return np.zeros_like(logits)
    weights = np.exp(logits - top)
    return weights / weights.sum()


def apply_repetition_penalty(logits, seen, penalty: float) -> np.ndarray:
    """A copy where the `seen` tokens' positive logits shrink and negative ones grow: both make
    them less likely."""
    out = as_logits(logits).copy()
    seen = np.asarray(seen, dtype=np.int64)
    picked = out[seen]
    out[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def apply_output_penalties(logits, output: list[int], frequency: float, presence: float) -> np.ndarray:
    """A copy with OpenAI's penalties: each token's logit minus frequency x its count in the
    output so far, minus presence once if it occurs at all."""
    ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    out = as_logits(logits).copy()
    out[ids] -= (frequency * counts + presence).astype(np.float32)
    return out


def apply_logit_bias(logits, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """A copy with each (token, value) added to the token's logit (OpenAI's logit_bias: -100 bans
    a token, +100 all but forces it)."""
    out = as_logits(logits).copy()
    for token, value in bias:
        out[token] += np.float32(value)
    return out


def keep_top_k(logits, k: int) -> np.ndarray:
    x = as_logits(logits)
    if k <= 0 or k >= x.shape[-1]:
        return x
    kth = np.partition(x, x.size - k)[x.size - k]
    return np.where(x < kth, np.float32(-np.inf), x)


def keep_top_p(logits, p: float) -> np.ndarray:
    """Keep the smallest set of tokens whose probability mass reaches p."""
    x = as_logits(logits)
    if p >= 1.0:
        return x
    order = np.argsort(-x, kind="stable")
    probs = softmax(x[order])
    drop = np.empty(x.size, dtype=bool)
    drop[order] = (np.cumsum(probs) - probs) >= p  # the mass before this token already reaches p
    return np.where(drop, np.float32(-np.inf), x)


def keep_min_p(logits, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the top token's."""
    x = as_logits(logits)
    if min_p <= 0.0:
        return x
    probs = softmax(x)
    return np.where(probs < probs.max() * min_p, np.float32(-np.inf), x)


class Sampler:
    """Stateful only in its random generator; call with the 1-D logits of one position."""

    def __init__(self, params: SamplingParams, prompt_tokens: int = 0):
        """`prompt_tokens`: how many of the history's first tokens are the prompt (the output
        penalties count the rest)."""
        self.params, self.prompt_tokens = params, prompt_tokens
        # no seed: a fresh one of our own (numpy's global generator is the caller's)
        seed = params.seed % 2**64 if params.seed is not None else secrets.randbits(64)
        self.generator = np.random.Generator(np.random.PCG64(seed))

    def __call__(self, logits, history: list[int]) -> int:
        penalized = self._penalized(logits, history)
        if self.params.temperature < GREEDY_BELOW:
            return greedy(penalized)
        token = self._native(penalized)
        return self.draw(self.probs(logits, history)) if token is None else token

    def probs(self, logits, history: list[int]) -> np.ndarray | None:
        """The distribution the next token is drawn from (penalty, temperature, top-k/p, min-p
        applied); None under greedy decoding."""
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return None
        x = self._penalized(logits, history) / np.float32(p.temperature)
        return softmax(keep_min_p(keep_top_p(keep_top_k(x, p.top_k), p.top_p), p.min_p))

    def uniform(self) -> float:
        """The next number in [0, 1) of this sampler's stream."""
        return float(self.generator.random())

    def draw(self, probs: np.ndarray) -> int:
        """A token drawn with the (unnormalized) weights `probs`."""
        cumulative = np.cumsum(probs, dtype=np.float64)
        total = cumulative[-1] if cumulative.size else 0.0
        if not total > 0 or not np.isfinite(total):
            raise NothingToDraw("no token has any probability left (every logit is -inf or NaN)")
        token = int(np.searchsorted(cumulative, self.uniform() * total, side="right"))
        return token if token < cumulative.size else int(np.flatnonzero(probs)[-1])  # u * total rounded up to total

    def candidates(self, logits) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, probabilities) of the tokens that probs() gives weight, found natively from the
        CANDIDATES largest logits (or top_k's) and the softmax's full denominator; None where the
        filters reach past them (then only the whole vocabulary tells) or nothing filters."""
        x = as_logits(logits)
        p, lib, n = self.params, library(), x.size
        if not (_native_input(x) and self._filters(n)):
            return None
        top_k = p.top_k if p.top_k < n else 0
        total = None
        for k in ([top_k] if top_k else sorted({min(c, n) for c in CANDIDATES})):
            found = _top_logits(x, k)
            if found is None:
                return None  # no memory for the native heap
            ids, values = found
            weights = np.exp((values.astype(np.float64) - float(values[0])) / p.temperature)  # the largest's is 1
            mass = float(weights.sum())
            whole = bool(top_k) or k == n  # exactly these tokens are left
            if whole:
                total = mass
            elif total is None:  # top_p needs the mass of the whole vocabulary
                total = lib.edgellm_exp_sum(x.ctypes.data, n, 1 / p.temperature, float(values[0]))
            if whole or (p.top_p < 1 and mass / total >= p.top_p) or (p.min_p > 0 and float(weights[-1]) < p.min_p):
                keep = (np.cumsum(weights) - weights) / total < p.top_p  # the mass before a token is short of top_p
                keep &= (weights >= p.min_p) & (weights > 0)  # min_p against the top token, whose weight is 1
                return ids[keep], weights[keep] / weights[keep].sum()
        return None

    def _filters(self, vocabulary: int) -> bool:
        p = self.params
        return 0 < p.top_k < vocabulary or p.top_p < 1 or p.min_p > 0

    def _native(self, x: np.ndarray) -> int | None:
        """A token drawn from (penalized) logits in one pass of kernels/sample.c; None where that
        path does not apply (no kernels, filters reaching past CANDIDATES)."""
        if not _native_input(x):
            return None
        found = None
        if self._filters(x.size):
            found = self.candidates(x)
            if found is None:
                return None  # the filters reach past the candidates: the whole vocabulary's path
        u = self.uniform()
        if found is not None:
            ids, probs = found
            return int(ids[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(ids) - 1)])
        lib, n = library(), x.size
        shift = float(x[lib.edgellm_argmax(x.ctypes.data, n)])
        token = lib.edgellm_draw(x.ctypes.data, n, 1 / self.params.temperature, shift, u)
        return token if token >= 0 else None  # no token of weight (all masked): draw() says so

    def _penalized(self, logits, history: list[int]) -> np.ndarray:
        x = as_logits(logits)
        p = self.params
        if p.repetition_penalty != 1.0 and history:
            x = apply_repetition_penalty(x, sorted(set(history)), p.repetition_penalty)
        output = history[self.prompt_tokens:]
        if (p.frequency_penalty or p.presence_penalty) and output:
            x = apply_output_penalties(x, output, p.frequency_penalty, p.presence_penalty)
        if p.logit_bias:
            x = apply_logit_bias(x, p.logit_bias)
        return x


NATIVE_TOP = 256  # above this many, the heap's k log k pops cost more than a selection (1024: ~0.33 ms)


def _top_logits(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, values) of the k largest of 1-D fp32 logits, largest first: the native heap for a
    few, numpy's introselect and a sort of the k for more; None where the heap got no memory."""
    if k <= NATIVE_TOP:
        ids, values = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.float32)
        if library().edgellm_top_logits(x.ctypes.data, x.size, k, ids.ctypes.data, values.ctypes.data) < 0:
            return None
        return ids, values
    picked = np.argpartition(x, x.size - k)[x.size - k:]
    picked = picked[np.argsort(-x[picked], kind="stable")]
    return picked.astype(np.int64), x[picked]
