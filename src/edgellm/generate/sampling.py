"""Logits -> next token. Small pure functions composed into one sampler; randomness comes
only from an explicit, seeded generator, so the same seed gives the same text."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

from edgellm.errors import InvalidRequest
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
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


# Below this temperature sampling is greedy: logits / T would overflow to inf (1e-300 did) long
# before the distribution stops being one-hot in float32.
GREEDY_BELOW = 1e-5
ARGMAX_ROW = 2048  # logits per row of greedy()'s first pass
# Logits a filtered draw (top-k, top-p, min-p) looks at natively, the few first: nucleus sampling
# at top_p 0.9-0.95 keeps tens of tokens of a small model's vocabulary. At temperature 1, top_p 0.9
# one SmolLM2 step in 10 kept 280-670 (then the tries up to 1024: ~0.45 ms, where torch's sort and
# multinomial over the vocabulary take ~5 ms, more than a decode step).
CANDIDATES = (256, 1024, 4096)


def greedy(logits: torch.Tensor) -> int:
    """int(logits.argmax()) of 1-D logits, the first maximum: the native kernel where there is one
    (it runs on this thread, where torch's reduction would wake its OpenMP workers, kernels/pool.h),
    else in two passes: torch's 1-D argmax is a scalar loop (~0.5 ms over Gemma's 262k logits, 2-5 %
    of a decode step), row maxima vectorize (~25 us)."""
    lib = library()
    if lib is not None and logits.dtype == torch.float32 and logits.is_contiguous() and logits.numel():
        return lib.edgellm_argmax(logits.data_ptr(), logits.numel())
    full = logits.shape[0] - logits.shape[0] % ARGMAX_ROW
    if full < 2 * ARGMAX_ROW:
        return int(logits.argmax())
    rows = logits[:full].reshape(-1, ARGMAX_ROW)
    row = int(rows.amax(1).argmax())
    best = row * ARGMAX_ROW + int(rows[row].argmax())
    if full < logits.shape[0]:
        tail = full + int(logits[full:].argmax())
        if logits[tail] > logits[best]:
            best = tail
    return best


def _native_input(logits: torch.Tensor) -> bool:
    """Whether kernels/sample.c can read these logits: fp32, 1-D, contiguous, and a library built."""
    return (library() is not None and logits.dtype == torch.float32 and logits.dim() == 1
            and logits.is_contiguous())


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    # Positive logits shrink, negative ones grow: both make seen tokens less likely. The copy is
    # numpy's: torch's copy of a vocabulary is an OpenMP region, which wakes its team (kernels/pool.h).
    out = torch.from_numpy(logits.detach().numpy().copy()) if logits.device.type == "cpu" else logits.clone()
    picked = out.gather(-1, seen)
    return out.scatter_(-1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= p  # mass before this token already >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def keep_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Stateful only in its random generator; call with the 1-D logits of one position."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        # no seed: a fresh one of our own (torch.seed() would reseed torch's global generator, the caller's)
        self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        penalized = self._penalized(logits, history)
        if self.params.temperature < GREEDY_BELOW:
            return greedy(penalized)
        token = self._native(penalized)
        return self.draw(self.probs(logits, history)) if token is None else token

    def probs(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor | None:
        """The distribution the next token is drawn from (penalty, temperature, top-k/p, min-p
        applied); None under greedy decoding."""
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return None
        logits = keep_min_p(keep_top_p(keep_top_k(self._penalized(logits, history) / p.temperature, p.top_k), p.top_p),
                            p.min_p)
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, probabilities) of the tokens that probs() gives weight, found natively from the
        CANDIDATES largest logits (or top_k's) and the softmax's full denominator; None where the
        filters reach past them (then only the whole vocabulary tells) or nothing filters."""
        p, lib, n = self.params, library(), logits.numel()
        if not (_native_input(logits) and self._filters(n)):
            return None
        top_k = p.top_k if p.top_k < n else 0
        total = None
        for k in ([top_k] if top_k else sorted({min(c, n) for c in CANDIDATES})):
            found = _top_logits(logits, k)
            if found is None:
                return None  # no memory for the native heap
            ids, values = found
            weights = ((values.double() - float(values[0])) / p.temperature).exp()  # the largest logit's is 1
            mass = float(weights.sum())
            whole = bool(top_k) or k == n  # exactly these tokens are left
            if whole:
                total = mass
            elif total is None:  # top_p needs the mass of the whole vocabulary
                total = lib.edgellm_exp_sum(logits.data_ptr(), n, 1 / p.temperature, float(values[0]))
            if whole or (p.top_p < 1 and mass / total >= p.top_p) or (p.min_p > 0 and float(weights[-1]) < p.min_p):
                keep = (weights.cumsum(0) - weights) / total < p.top_p  # the mass before a token is short of top_p
                keep &= (weights >= p.min_p) & (weights > 0)  # min_p against the top token, whose weight is 1
                return ids[keep], weights[keep] / weights[keep].sum()
        return None

    def _filters(self, vocabulary: int) -> bool:
        p = self.params
        return 0 < p.top_k < vocabulary or p.top_p < 1 or p.min_p > 0

    def _native(self, logits: torch.Tensor) -> int | None:
        """A token drawn from (penalized) logits without torch's parallel reductions
        (kernels/sample.c); None where that path does not apply (no kernels, filters reaching past
        CANDIDATES)."""
        if not _native_input(logits):
            return None
        found = None
        if self._filters(logits.numel()):
            found = self.candidates(logits)
            if found is None:
                return None  # the filters reach past the candidates: the whole vocabulary's path
        u = torch.rand(1, dtype=torch.float64, generator=self.generator)
        if found is not None:
            ids, probs = found
            return int(ids[min(int(torch.searchsorted(probs.cumsum(0), u, right=True)), len(ids) - 1)])
        lib, n = library(), logits.numel()
        shift = float(logits[lib.edgellm_argmax(logits.data_ptr(), n)])
        token = lib.edgellm_draw(logits.data_ptr(), n, 1 / self.params.temperature, shift, float(u))
        return token if token >= 0 else None  # no token of weight (all masked): torch's path says so

    def _penalized(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        logits = logits.float()
        p = self.params
        if p.repetition_penalty != 1.0 and history:
            logits = apply_repetition_penalty(logits, torch.tensor(sorted(set(history))), p.repetition_penalty)
        return logits


NATIVE_TOP = 256  # above this many, the heap's k log k pops cost more than a selection (1024: ~0.33 ms)


def _top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, values) of the k largest of 1-D fp32 logits, largest first: the native heap for a
    few, numpy's introselect and a sort of the k for more; None where the heap got no memory."""
    if k <= NATIVE_TOP:
        ids, values = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
        if library().edgellm_top_logits(logits.data_ptr(), logits.numel(), k, ids.data_ptr(), values.data_ptr()) < 0:
            return None
        return ids, values
    x = logits.numpy()
    picked = np.argpartition(x, x.size - k)[x.size - k:]
    picked = picked[np.argsort(-x[picked], kind="stable")]
    return torch.from_numpy(picked.astype(np.int64)), torch.from_numpy(x[picked])
