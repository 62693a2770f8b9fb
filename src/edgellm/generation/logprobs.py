"""Log-probabilities as clients ask for them (OpenAI's `logprobs` / `top_logprobs`, and a prompt's
own tokens scored for `echo`): the model's own log-softmax of a position's logits, before
temperature, penalties, biases or a constraint's mask change what is sampled from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position, most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits (..., V) -> their log-softmax in float64 (-inf stays -inf)."""
    x = np.asarray(logits, dtype=np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    return x - top - np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """One position's log-probability of `token`, with its `top` most likely alternatives."""
    row = log_softmax(logits)
    return TokenLogprob(int(token), float(row[token]), _top(row, top))


def rows_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row i of (T, V) logits scoring tokens[i]."""
    rows = log_softmax(logits)
    return [TokenLogprob(int(t), float(rows[i, t]), _top(rows[i], top)) for i, t in enumerate(tokens)]


def _top(row: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    k = min(k, row.size)
    picked = np.argpartition(-row, k - 1)[:k]
    picked = picked[np.argsort(-row[picked], kind="stable")]
    return tuple((int(i), float(row[i])) for i in picked)
