"""The cache protocol and its simplest implementation: a contiguous buffer that grows
in steps with the tokens actually held, never pre-allocated to the maximum context."""
from __future__ import annotations

from typing import Protocol

import torch

GROWTH_STEP = 256  # tokens added per reallocation; amortizes copies, bounds waste


class KVCache(Protocol):
    offset: int  # tokens written so far == position of the next token

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def trim(self, n: int) -> int: ...
    @property
    def nbytes(self) -> int: ...


class DenseCache:
    """Keys and values for one layer, shaped (batch, kv_heads, tokens, head_dim)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.offset = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = k.shape[2]
        self._reserve(k, v, self.offset + new)
        self._k[:, :, self.offset:self.offset + new] = k
        self._v[:, :, self.offset:self.offset + new] = v
        self.offset += new
        return self._k[:, :, :self.offset], self._v[:, :, :self.offset]

    def _reserve(self, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
        capacity = 0 if self._k is None else self._k.shape[2]
        if tokens <= capacity:
            return
        size = -(-tokens // GROWTH_STEP) * GROWTH_STEP
        k_buf = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3], dtype=self.dtype)
        v_buf = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3], dtype=self.dtype)
        if self._k is not None:
            k_buf[:, :, :self.offset] = self._k[:, :, :self.offset]
            v_buf[:, :, :self.offset] = self._v[:, :, :self.offset]
        self._k, self._v = k_buf, v_buf

    def trim(self, n: int) -> int:
        """Forget the last n tokens (e.g. rejected speculative tokens); returns how many were."""
        n = min(n, self.offset)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() * 2


def make_caches(n_layers: int, dtype: torch.dtype = torch.float32) -> list[DenseCache]:
    return [DenseCache(dtype) for _ in range(n_layers)]
